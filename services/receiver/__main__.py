"""`slipstream receiver`: the weight receiver beside an engine."""

import sys

from services.common.config import command_config
from services.receiver.config import ReceiverConfig


def main(argv: list[str] | None = None) -> int:
    config = command_config(ReceiverConfig, argv, "receiver")
    if config is None:
        return 2
    from services.receiver.server import serve  # torch: after the settings are read, so that --help is instant

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
