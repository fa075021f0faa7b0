"""The command-line contract with real SGLang and sglang-router releases, read from their wheels: the option list that
ships with slipstream is the pinned release's, every SGLang option we pass anywhere (run files, compose, Kubernetes,
the launcher, the reference engine's own) is a server argument of the pinned and the oldest supported release, every
router flag the gateway passes is the pinned router's, and `slipstream train` refuses an unknown --sglang-<option>."""

import ast
import re
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from services.common.config import ConfigError
from services.engine.config import EngineConfig
from services.rollout import adapters, launch, sglang_options
from services.rollout.config import RolloutConfig
from services.train.options import route
from tests.contract.sglang_release import router_options
from tests.python_source import parse
from tools.sglang_server_args import listing

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("deploy", "services", "examples")  # what we run: run files, compose and k8s files, code, examples
PASSED = re.compile(r"--sglang-[a-z0-9][a-z0-9-]*[a-z0-9]")
GATEWAYS_OWN = {"--" + name.replace("_", "-") for name in RolloutConfig.model_fields}  # --sglang-server-concurrency
# The reference engine's own options, which SGLang lacks: its receive deadline, and the one folder it loads weights
# from (the launcher passes it to reference engines only, in the branch that starts them).
ENGINES_OWN = {"--weight-update-timeout-s", "--weight-disk-dir"}


def test_the_shipped_option_list_is_what_the_pinned_wheel_gives(pinned):
    """services/rollout/sglang_server_args.txt (what `slipstream train` checks against) is tools/sglang_server_args.py's
    output for the pinned wheel, byte for byte."""
    assert sglang_options.LIST.read_text() == listing(pinned.wheel), (
        f"regenerate it: python tools/sglang_server_args.py {pinned.wheel} > {sglang_options.LIST.relative_to(REPO)}"
    )


def test_the_sglang_images_are_the_pinned_release():
    """The engines' container images (compose's .env and default, the k8s kustomization) run the pinned release."""
    release = sglang_options.pinned()[0]
    compose = REPO / "deploy" / "compose"
    tags = re.findall(r"lmsysorg/sglang:v([^-\s}]+)-", (compose / ".env").read_text())
    tags += re.findall(r"lmsysorg/sglang:v([^-\s}]+)-", (compose / "docker-compose.yml").read_text())
    kustomization = yaml.safe_load((REPO / "deploy" / "k8s" / "kustomization.yaml").read_text())
    tags += [i["newTag"][1:].split("-")[0] for i in kustomization["images"] if i["name"] == "lmsysorg/sglang"]
    assert len(tags) == 3 and set(tags) == {release}, tags


def test_every_sglang_option_we_pass_is_a_server_argument(release):
    """--sglang-<option> in every shipped file, the options of the SGLang command lines in the compose and k8s
    files and of the launcher's, and the reference engine's options (which take SGLang's names)."""
    unknown = {}
    for flag, where in passed_sglang_options().items():
        if "--" + flag.removeprefix("--sglang-") not in release.server_options:
            unknown[flag] = where
    for option, where in [*engine_command_options(), *launcher_options(), *reference_engine_options()]:
        if option not in release.server_options:
            unknown[option] = where
    assert not unknown, f"not server arguments of sglang {release.version}: {unknown}"


def test_the_launcher_starts_modules_the_releases_have(pinned, router_wheel):
    with zipfile.ZipFile(pinned.wheel) as sglang, zipfile.ZipFile(router_wheel) as router:
        files = set(sglang.namelist()) | set(router.namelist())
    args = _literal_args(launch.engine_command) + _literal_args(launch.launch_router)
    modules = [args[i + 1] for i, arg in enumerate(args) if arg == "-m" and str(args[i + 1]).startswith("sglang")]
    assert modules == ["sglang.launch_server", "sglang_router.launch_router"]
    for module in modules:
        assert module.replace(".", "/") + ".py" in files, module


def test_every_router_flag_the_gateway_passes_is_the_pinned_routers(router_wheel):
    """launch_router's flags are sglang-router's, and a literal value is one of the flag's choices where it has them."""
    options = router_options(router_wheel)
    args = _literal_args(launch.launch_router)
    flags = [a for a in args if isinstance(a, str) and a.startswith("--")]
    assert flags and set(flags) <= set(options), set(flags) - set(options)
    for flag, value in zip(args, [*args[1:], None], strict=True):
        if flag in flags and options[flag] is not None and isinstance(value, str):
            assert value in options[flag], f"{flag} {value}: sglang-router takes {options[flag]}"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--sglang-mem-fraction-statc",
         "unknown SGLang option --sglang-mem-fraction-statc; did you mean --sglang-mem-fraction-static?"),
        ("--sglang-router-ip",
         "unknown SGLang option --sglang-router-ip; the gateway starts an sglang-router with --use-router"),
    ],
)  # fmt: skip
def test_slipstream_train_refuses_an_unknown_sglang_option_naming_the_closest(flag, message):
    with pytest.raises(ConfigError) as refused:
        route(["--hf-checkpoint", "m", flag, "0.8"])
    assert str(refused.value).startswith(message)


def test_slipstream_train_passes_the_pinned_releases_options_and_keeps_its_own():
    routed = route(["--sglang-mem-fraction-static", "0.8", "--sglang-enable-memory-saver", "--sglang-api-key=key",
                    "--sglang-server-concurrency", "64"])["rollout"]  # fmt: skip
    assert routed == ["--sglang-mem-fraction-static", "0.8", "--sglang-enable-memory-saver", "--sglang-api-key=key",
                      "--sglang-server-concurrency", "64"]  # fmt: skip


def passed_sglang_options() -> dict[str, str]:
    """--sglang-<option> → a shipped file naming it (the gateway's own --sglang-server-concurrency aside)."""
    found = {}
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *SHIPPED], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    for name in listed:
        try:
            text = (REPO / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):  # binary, or deleted but not yet committed
            continue
        for flag in set(PASSED.findall(text)) - GATEWAYS_OWN:
            found.setdefault(flag, name)
    assert "--sglang-mem-fraction-static" in found, "the run files' options were not found"
    return found


def engine_command_options() -> list[tuple[str, str]]:
    """The options of the SGLang command lines in the compose and k8s files (before the run file's, added by sed)."""
    found = []
    for path in sorted((REPO / "deploy").rglob("*.y*ml")):
        for command in re.findall(r"sglang\.launch_server(.*?)\$\(sed", path.read_text(), re.DOTALL):
            found += [(option, str(path.relative_to(REPO))) for option in re.findall(r"--[a-z][a-z0-9-]*", command)]
    assert len({where for _, where in found}) == 2, found  # compose's engine and the k8s StatefulSet's
    return found


def launcher_options() -> list[tuple[str, str]]:
    args = _literal_args(launch.engine_command)
    lora = adapters.server_options(SimpleNamespace(lora_rank=8, target_modules=["all-linear", "lm_head"]))
    found = [(a, "services/rollout/launch.py") for a in args if isinstance(a, str) and a.startswith("--")
             and a not in ENGINES_OWN]  # fmt: skip
    return found + [(a, "services/rollout/adapters.py") for a in lora if a.startswith("--")]


def reference_engine_options() -> list[tuple[str, str]]:
    flags = {"--" + name.replace("_", "-") for name in EngineConfig.model_fields} - ENGINES_OWN
    return [(flag, "services/engine/config.py") for flag in sorted(flags)]


def _literal_args(function) -> list:
    """A launcher function's command-line literals, in order ("--host", "-m", …); anything computed is None."""
    tree = parse(Path(launch.__file__).read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
               and n.name == function.__name__]  # fmt: skip
    lists = [n for n in ast.walk(node) if isinstance(n, ast.List)]
    return [e.value if isinstance(e, ast.Constant) else None for n in lists for e in n.elts]
