"""`slipstream engine`: runs the reference engine (SGLang's HTTP API on an HF model)."""

import sys

from services.common.config import command_config
from services.engine.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    config = command_config(EngineConfig, argv, "engine")
    if config is None:
        return 2
    from services.engine.server import serve  # torch: after the settings are read, so that --help is instant

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
