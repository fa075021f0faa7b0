"""`@FILE` on a command line: a run's settings as one file of `slipstream train` flags, in slime's names, which every
container of a deployment reads. `slipstream train @run.flags` takes every flag; a service takes the ones that
`slipstream train` would give it; the reference engine takes the `--sglang-*` ones without their prefix."""

import shlex
from pathlib import Path

from services.common.config import ConfigError


def read(path: Path) -> list[str]:
    """The file's flags: shell words, any number a line, `#` comments."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"@{path}: cannot read the run file ({e.strerror}); mount it or fix the path") from None
    return [word for line in text.splitlines() for word in shlex.split(line, comments=True)]


def expand(command: str, argv: list[str]) -> list[str]:
    """`argv` with each `@FILE` replaced by the flags of FILE that `command` takes (flags after it override them)."""
    expanded: list[str] = []
    for arg in argv:
        if not arg.startswith("@"):
            expanded.append(arg)
            continue
        flags = read(Path(arg[1:]))
        if command in ("train", "demo"):
            expanded += flags
        elif command == "engine":
            expanded += [
                f"--{a.removeprefix('--sglang-')}" if a.startswith("--sglang-") else a for a in _sglang_chunks(flags)
            ]
        else:
            from services.train.options import route

            expanded += route(flags)[command]
    return expanded


def _sglang_chunks(flags: list[str]) -> list[str]:
    """The `--sglang-*` flags with their values."""
    kept, keep = [], False
    for arg in flags:
        if arg.startswith("--"):
            keep = arg.startswith("--sglang-")
        if keep:
            kept.append(arg)
    return kept
