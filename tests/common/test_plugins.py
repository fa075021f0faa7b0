"""The plugin loader: `pkg.module:function` and `file.py:function`, with errors that say what is missing."""

import pytest

from services.common.plugins import PluginError, load_callable


def test_module_path():
    assert load_callable("os.path:join")("a", "b") == "a/b"


def test_slimes_dotted_form():
    assert load_callable("os.path.join")("a", "b") == "a/b"


def test_nested_attribute():
    assert load_callable("pathlib:Path.cwd")() is not None


def test_file_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(x):\n    return x * 2\n")
    assert load_callable(f"{path}:score")(3) == 6


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("join", "must look like 'pkg.module:function'"),
        ("no_such_pkg.mod:fn", "module 'no_such_pkg.mod' was not found"),
        ("os.path:nope", "os.path has no attribute 'nope' \\(callables there: .*join"),
        ("os:sep", "sep is a str, not a function or class"),
        ("/nowhere/x.py:fn", "file /nowhere/x.py does not exist"),
    ],
)
def test_errors_say_what_was_not_found(spec, message):
    with pytest.raises(PluginError, match=message):
        load_callable(spec, what="--custom-rm-path")


def test_error_inside_the_plugin_is_reported(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match=r"loading .*broken\.py raised RuntimeError: boom"):
        load_callable(f"{path}:fn")


def test_missing_dependency_of_the_plugin_is_named(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(PluginError, match="importing 'needs_dep' failed because 'not_installed_dep' is not installed"):
        load_callable("needs_dep:fn")
