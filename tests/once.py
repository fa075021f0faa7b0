"""A folder made once for the whole test session, whichever test process gets there first: `make test` runs two
(pytest-xdist), and a module's fixture would otherwise be made by each one that runs a test of the module."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make(folder)` once a session: the other test processes wait for it (a file lock)
    and use it as it is. A `make` that raised leaves it to the next one to try again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    folder = root / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / ".made").touch()
    return folder
