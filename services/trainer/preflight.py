"""What the trainer checks before it trains, run as well by `slipstream train` (and its `--check`) before any service
starts: the custom functions it is given (loss, advantages, reward post-processing, …) import. Without torch: the
service image runs it too, in every service's `slipstream <service> @run.flags`."""

from services.common.plugins import check_plugins
from services.trainer.config import TrainerConfig

NAMES = (
    "custom_convert_samples_to_train_data_path",
    "custom_reward_post_process_path",
    "custom_advantage_function_path",
    "custom_tis_function_path",
    "custom_loss_function_path",
    "custom_rollout_log_function_path",
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(config: TrainerConfig) -> None:
    """Raises ConfigError naming the flag and what is missing."""
    check_plugins({flag(name): getattr(config, name) for name in NAMES})
