"""`slipstream rollout`: runs the rollout service."""

import sys

from services.common.server import main_for
from services.rollout.config import RolloutConfig
from services.rollout.server import build


def main(argv: list[str] | None = None) -> int:
    return main_for("rollout", RolloutConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
