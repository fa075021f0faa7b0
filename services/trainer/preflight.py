"""What the trainer checks before it trains, run as well by `slipstream train` (and its `--check`) before any service
starts: the custom functions it is given (loss, advantages, reward post-processing, …) import."""

from services.common.plugins import check_plugins
from services.trainer.config import TrainerConfig
from services.trainer.hooks import NAMES, flag


def check(config: TrainerConfig) -> None:
    """Raises ConfigError naming the flag and what is missing."""
    check_plugins({flag(name): getattr(config, name) for name in NAMES})
