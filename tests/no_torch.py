"""For tests: `python -m tests.no_torch <slipstream command and flags>` runs a command in a process where the
packages of the `trainer` and `engine` extras cannot be imported, as in an install without them (the slim image)."""

import importlib.abc
import importlib.util
import sys

from services.train.cli import main

BLOCKED = {"torch", "megatron", "safetensors", "tensorboard", "starlette", "uvicorn"}


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not installed)", name=name)
        return None


def find_spec(name, package=None):
    """As for a package that is not installed: None (transformers asks this before it imports torch)."""
    return None if name.split(".")[0] in BLOCKED else _find_spec(name, package)


_find_spec = importlib.util.find_spec

if __name__ == "__main__":
    sys.meta_path.insert(0, Blocker())
    importlib.util.find_spec = find_spec
    sys.exit(main(sys.argv[1:]))
