"""`slipstream trainer`: runs the trainer service."""

import sys

from services.common.server import main_for
from services.trainer.config import TrainerConfig
from services.trainer.server import build


def main(argv: list[str] | None = None) -> int:
    return main_for("trainer", TrainerConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
