"""`slipstream buffer`: runs the buffer service."""

import sys

from services.buffer.config import BufferConfig
from services.buffer.server import build
from services.common.server import main_for


def main(argv: list[str] | None = None) -> int:
    return main_for("buffer", BufferConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
