"""`slipstream engine`: runs the reference engine (SGLang's HTTP API on an HF model)."""

import sys

from services.common.config import ConfigError, load_config
from services.rollout.engine.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(EngineConfig, argv, prog="slipstream engine")
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"slipstream engine: error: {line}", file=sys.stderr)
        return 2
    from services.rollout.engine.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
