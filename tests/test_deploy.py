"""deploy/compose: both forms of the stack render with the compose tool (podman-compose here, or docker compose), and
every slipstream container's command line — its run file included — is accepted by our parsers (`--check`). The
stack itself runs in real containers in `make deploy-check`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.tiny_checkpoint import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "compose"


def _compose_tool() -> list[str] | None:
    if shutil.which("podman"):
        return [sys.executable, "-m", "podman_compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


TOOL = _compose_tool()
FORMS = {  # name: (env file, compose files, what the run file's /data must hold)
    "gpu-node": (COMPOSE / ".env", ["docker-compose.yml"], ["Qwen3-4B", "dapo-math-17k.jsonl"]),
    "cpu": (COMPOSE / "cpu.env", ["docker-compose.yml", "cpu.yml"], ["model", "data/train.jsonl", "data/eval.jsonl"]),
    "external-reward": (
        COMPOSE / ".env",
        ["docker-compose.yml", "reward-external.yml"],
        ["Qwen3-4B", "dapo-math-17k.jsonl"],
    ),
}


def render(form: str, data: Path) -> dict:
    env_file, files, _ = FORMS[form]
    command = [*TOOL, "--env-file", str(env_file), *(a for f in files for a in ("-f", str(COMPOSE / f))), "config"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(data), "DATA_DIR": str(data)}  # the data folder of this test
    result = subprocess.run(command, capture_output=True, text=True, cwd=COMPOSE, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_container_command_line_is_accepted(form, tmp_path):
    data = tmp_path / "data"
    for item in FORMS[form][2]:  # what the run file names, so that the checks of files pass
        target = data / item
        if target.suffix == ".jsonl":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text('{"prompt": "1 + 1", "label": "2"}\n')
        else:
            write_tiny_model(target)
    config = render(form, data)
    services = config["services"]
    assert {"redis", "buffer", "reward", "rollout", "engine-0", "job"} <= set(services)
    assert "--requirepass" in services["redis"]["command"] and "--appendonly" in services["redis"]["command"]
    run_file = next(Path(v.split(":")[0]) for v in services["job"]["volumes"] if "/etc/slipstream/run.flags" in v)
    flags = tmp_path / "run.flags"  # the containers' /data is this test's folder
    flags.write_text((COMPOSE / run_file).read_text().replace("/data", str(data)))
    checked = []
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("slipstream") or service.get("entrypoint") not in (
            None,
            ["slipstream"],
        ):
            continue
        args = [a.replace("@/etc/slipstream/run.flags", f"@{flags}").replace("/data", str(data))
                for a in service["command"]]  # fmt: skip
        args = [a.replace("/runs", str(tmp_path / "runs")) for a in args]
        result = subprocess.run([sys.executable, "-m", "slipstream", *args, "--check"], capture_output=True,
                                text=True, cwd=tmp_path, timeout=120)  # fmt: skip
        assert result.returncode == 0, f"{name}: {result.stderr}"
        checked.append(name)
    expected = {"buffer", "reward", "rollout", "job"} | ({"engine-0"} if form == "cpu" else set())
    assert set(checked) == expected
    assert services["reward"]["deploy"]["replicas"] in (2, "2")  # stateless replicas behind one name
    if form == "external-reward":  # the judges run beside the reward service, and the run asks for theirs
        assert {"judge", "judge-http"} <= set(services)
        assert (
            "judge:50060" in services["reward"]["command"]
            and "http://judge-http:8060/score" in services["reward"]["command"]
        )
        assert services["rollout"]["command"][-2:] == ["--rm-type", "remote_grpc"]
    if form != "cpu":  # SGLang's engines: GPUs by device id, the host's IPC, the run file's --sglang-* options
        engine = services["engine-0"]
        assert engine["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
        assert engine["ipc"] == "host" and "sed -n 's/^--sglang-/--/p'" in " ".join(engine["entrypoint"])
        assert services["job"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
    else:
        assert "deploy" not in services["engine-0"] and "deploy" not in services["job"]
