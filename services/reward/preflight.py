"""What the reward service checks before it serves, run as well by `slipstream train` (and its `--check`) before any
service starts: the reward types it is asked for (with a did-you-mean), and the custom function, imported and called
the way the workers will call it."""

import difflib
import inspect

from services.common.config import ConfigError
from services.common.plugins import PluginError, load_callable
from services.reward.config import RewardConfig
from services.reward.trl_style import is_trl_style
from services.reward.verifiers import BUILT_IN, DEFAULT_RM_TYPE, RM_TYPES, is_known


def check(config: RewardConfig) -> bool:
    """Raises ConfigError naming the flag and the fix; returns whether --custom-rm-path is a function written for TRL
    (trl_style.py)."""
    if config.custom_rm_path:
        return _check_function(config.custom_rm_path, config.group_rm)
    check_rm_type("--rm-type", config.rm_type or DEFAULT_RM_TYPE)
    for name, rm_type in config.eval_rm_types().items():
        check_rm_type(f"--eval-config set {name!r}: rm_type", rm_type)
    return False


def check_rm_type(what: str, rm_type: str) -> None:
    if is_known(rm_type):
        return
    close = difflib.get_close_matches(rm_type, [*RM_TYPES, *(f"boxed_{name}" for name in BUILT_IN)], n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"{what} {rm_type!r} is unknown; {hint}use one of {', '.join(RM_TYPES)}, or pass --custom-rm-path"
    )


def _check_function(path: str, group: bool) -> bool:
    try:
        function = load_callable(path, "--custom-rm-path")
    except PluginError as e:
        raise ConfigError(str(e)) from None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or an extension's callable: nothing to read
        return False
    if is_trl_style(function):
        try:
            signature.bind(prompts=[], completions=[], label=[])
        except TypeError as e:
            raise ConfigError(
                f"--custom-rm-path {path}: {getattr(function, '__name__', path)}{signature} is written for TRL, and "
                f"is called with prompts, completions, label and the metadata's keys ({e}); take **kwargs for the rest"
            ) from None
        return True
    call = "fn(args, samples) with --group-rm" if group else "fn(args, sample)"
    try:
        signature.bind(None, None)
    except TypeError as e:
        raise ConfigError(
            f"--custom-rm-path {path}: {getattr(function, '__name__', path)}{signature} cannot be called as {call} "
            f"({e}); give it the parameters (args, {'samples' if group else 'sample'}) or TRL's (completions, **kw)"
        ) from None
    return False
