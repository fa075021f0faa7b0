"""The buffer's Redis scripts live in services/buffer/lua/, one file a script: every file is used, each script
compiles in a real Redis, the package ships the files, and no Lua is left in a Python string of the buffer."""

import tomllib
from pathlib import Path

from services.buffer import dataplane, store

REPO = Path(__file__).resolve().parents[2]
BUFFER = REPO / "services" / "buffer"
LUA_FILES = sorted((BUFFER / "lua").glob("*.lua"))


def test_every_script_file_is_loaded_and_compiles(redis_client):
    """The functions files go before the scripts, so a script compiles only with them: SCRIPT LOAD of each whole
    script checks every file's syntax."""
    scripts = [*store._SCRIPTS.values(), dataplane.SUBMIT_FUNCTIONS + dataplane._SUBMIT_MANY]
    for path in LUA_FILES:
        assert any(path.read_text() in script for script in scripts), f"{path.name} is in no script"
    for script in scripts:
        assert redis_client.script_load(script)


def test_the_package_ships_the_script_files():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["services.buffer"]
    assert LUA_FILES
    assert [p.name for p in LUA_FILES if not any(p.relative_to(BUFFER).match(glob) for glob in shipped)] == []


def test_no_lua_is_left_in_the_buffers_python():
    assert [str(p.relative_to(REPO)) for p in sorted(BUFFER.rglob("*.py")) if "redis.call(" in p.read_text()] == []
