"""`slipstream reward`: runs the reward service."""

import sys

from services.common.server import main_for
from services.reward.config import RewardConfig
from services.reward.server import build


def main(argv: list[str] | None = None) -> int:
    return main_for("reward", RewardConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
