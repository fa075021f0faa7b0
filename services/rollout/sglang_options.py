"""SGLang's server options as the pinned release has them (sglang_server_args.txt beside this file, written from the
release's wheel by tools/sglang_server_args.py): `slipstream train` refuses a --sglang-<option> that is none of them
before anything starts, naming the closest one."""

import difflib
import functools
import re
from pathlib import Path

from services.common.config import ConfigError

LIST = Path(__file__).with_name("sglang_server_args.txt")
PREFIX = "--sglang-"


@functools.cache
def pinned() -> tuple[str, frozenset[str]]:
    """The pinned release (read from the list's header) and its server's options."""
    lines = LIST.read_text().splitlines()
    release = re.search(r"from sglang-([^-]+)-", lines[0]).group(1)
    return release, frozenset(line for line in lines[1:] if line.startswith("--"))


def check(flag: str) -> None:
    """Raises ConfigError when `flag` (--sglang-<option>) names no server option of the pinned release."""
    option = "--" + flag.removeprefix(PREFIX)
    release, options = pinned()
    if option in options:
        return
    close = difflib.get_close_matches(option, sorted(options), n=1)
    if flag.startswith(PREFIX + "router-"):
        hint = "the gateway starts an sglang-router with --use-router (docs/ARGUMENTS.md)"
    elif close:
        hint = f"did you mean {PREFIX}{close[0].removeprefix('--')}?"
    else:
        hint = f"the options are SGLang {release}'s server arguments (python -m sglang.launch_server --help)"
    raise ConfigError(f"unknown SGLang option {flag}; {hint}")
