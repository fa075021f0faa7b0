"""Loads user code named by a path: `pkg.module:function` or `path/to/file.py:function`.

Custom reward functions, generate functions, data sources and filters all plug in through this one loader, which says
exactly what it could not find.
"""

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path


class PluginError(Exception):
    """The plugin path does not resolve to a callable; the message says which part was not found."""


def load_callable(spec: str, what: str = "plugin") -> Callable:
    """Resolves `spec` (`pkg.module:function`, slime's `pkg.module.function`, or `path/file.py:function`) to the
    callable it names; `what` names the option in errors (e.g. "--custom-rm-path")."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep and not spec.endswith(".py"):  # slime's form, pkg.module.function
        module_part, sep, attr = spec.rpartition(".")
    if not sep or not module_part or not attr:
        raise PluginError(f"{what} {spec!r} must look like 'pkg.module:function' or 'path/to/file.py:function'")
    module = _load_file(module_part, what) if module_part.endswith(".py") else _import(module_part, what)
    target = module
    for name in attr.split("."):
        if not hasattr(target, name):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            found = ", ".join(public) or "none"
            raise PluginError(f"{what} {spec!r}: {module_part} has no attribute {attr!r} (callables there: {found})")
        target = getattr(target, name)
    if not callable(target):
        raise PluginError(f"{what} {spec!r}: {attr} is a {type(target).__name__}, not a function or class")
    return target


def _import(module_name: str, what: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise PluginError(
                f"{what}: module {module_name!r} was not found; check the spelling, install its package, "
                "or add its folder to PYTHONPATH"
            ) from None
        raise PluginError(f"{what}: importing {module_name!r} failed because {e.name!r} is not installed") from None
    except Exception as e:
        raise PluginError(f"{what}: importing {module_name!r} raised {type(e).__name__}: {e}") from None


def _load_file(file_name: str, what: str):
    path = Path(file_name).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{what}: file {file_name} does not exist")
    module_name = f"slipstream_plugin_{path.stem}_{abs(hash(str(path)))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise PluginError(f"{what}: loading {file_name} raised {type(e).__name__}: {e}") from None
    return module


def check_plugins(paths: dict[str, str | None]) -> None:
    """Imports each plugin of `paths` ({what it is, as errors name it: its path}; empty ones skipped) before anything
    starts; raises ConfigError with the loader's sentence."""
    from services.common.config import ConfigError  # here: the reward workers import this module, not the configs

    for what, path in paths.items():
        if path:
            try:
                load_callable(path, what)
            except PluginError as e:
                raise ConfigError(str(e)) from None
