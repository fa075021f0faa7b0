"""`slipstream receiver`: the weight receiver beside an engine."""

import sys

from services.common.config import ConfigError, load_config
from services.receiver.config import ReceiverConfig


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(ReceiverConfig, argv, prog="slipstream receiver")
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"slipstream receiver: error: {line}", file=sys.stderr)
        return 2
    from services.receiver.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
