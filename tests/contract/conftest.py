"""The real SGLang and sglang-router releases the contract tests read: their wheels, downloaded from PyPI once (pip,
without dependencies) into .cache/sglang/ and reused from there. A download that fails fails the tests, saying how to
put the wheel there by hand."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.rollout import sglang_options
from tests.contract.sglang_release import Release

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "sglang"
PINNED = sglang_options.pinned()[0]  # the release services/rollout/sglang_server_args.txt was written from
OLDEST = "0.5.9"  # the oldest SGLang the gateway supports (docs/engine.md, "SGLang versions")
ROUTER = "0.3.2"  # the sglang-router release --use-router launches
# One build of each release whatever machine runs the tests (0.5.23's wheels are per Python version and platform;
# their Python sources are the same): the one the shipped option list names.
PLATFORM = ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_17_x86_64"]


def wheel(project: str, version: str) -> Path:
    """The project's wheel of that version in the cache, downloaded first if it is not there."""
    pattern = f"{project.replace('-', '_')}-{version}-*.whl"
    found = sorted(CACHE.glob(pattern))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    # This process's own folder (pytest-xdist workers may download at once), moved into place whole: an interrupted
    # download is not taken.
    partial = Path(tempfile.mkdtemp(prefix=f".download-{project}-{version}-", dir=CACHE))
    command = [sys.executable, "-m", "pip", "download", f"{project}=={version}", "--no-deps", "--only-binary=:all:",
               *PLATFORM, "--dest", str(partial), "--quiet"]  # fmt: skip
    try:  # within the test's own deadline (pytest-timeout, 300 s)
        result = subprocess.run(command, capture_output=True, text=True, timeout=240)
        error = result.stderr.strip()[-800:] if result.returncode else ""
    except subprocess.TimeoutExpired:
        error = "no download within 240 s"
    downloaded = sorted(partial.glob(pattern))
    if error or not downloaded:
        shutil.rmtree(partial, ignore_errors=True)
        pytest.fail(
            f"could not download {project}=={version} from PyPI for the SGLang contract tests "
            f"({' '.join(command[2:])}: {error or 'no wheel'}); reach PyPI, or put the wheel into {CACHE} yourself",
            pytrace=False,
        )
    target = CACHE / downloaded[0].name
    downloaded[0].replace(target)
    shutil.rmtree(partial)
    return target


@pytest.fixture(scope="session")
def pinned() -> Release:
    return Release(wheel("sglang", PINNED))


@pytest.fixture(scope="session")
def oldest() -> Release:
    return Release(wheel("sglang", OLDEST))


@pytest.fixture(scope="session", params=["pinned", "oldest"])
def release(request) -> Release:
    """Each supported end: the pinned release and the oldest one."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def router_wheel() -> Path:
    return wheel("sglang-router", ROUTER)
