"""What the gateway checks before it serves, run as well by `slipstream train` (and its `--check`) before any
service starts: the generate and rollout functions it is given import."""

from services.common.plugins import check_plugins
from services.rollout.config import RolloutConfig


def check(config: RolloutConfig) -> None:
    """Raises ConfigError naming the flag and what is missing."""
    paths = {
        "--custom-generate-function-path": config.custom_generate_function_path,
        "--rollout-function-path": config.rollout_function_path,
    }
    for eval_set in config.eval_sets():
        paths[f"--eval-config set {eval_set.name!r}: generate function"] = eval_set.custom_generate_function_path
    check_plugins(paths)
