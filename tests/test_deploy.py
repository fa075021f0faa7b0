"""deploy/compose: both forms of the stack render with the compose tool (podman-compose here, or docker compose), and
every slipstream container's command line — its run file included — is accepted by our parsers (`--check`). The
stack itself runs in real containers in `make deploy-check`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.train.tiny_checkpoint import write_tiny_model
from tests.redis_servers import check_redis_password_from_file

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
    "mps": (COMPOSE / ".env", ["docker-compose.yml", "mps.yml"], ["Qwen3-4B", "dapo-math-17k.jsonl"]),
}


def render(form: str, data: Path) -> dict:
    env_file, files, _ = FORMS[form]
    command = [*TOOL, "--env-file", str(env_file), *(a for f in files for a in ("-f", str(COMPOSE / f))), "config"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(data), "DATA_DIR": str(data)}  # the data folder of this test
    result = subprocess.run(command, capture_output=True, text=True, cwd=COMPOSE, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def run_flags(services: dict, data: Path, tmp_path: Path, extra: str = "") -> Path:
    """The stack's run file, its /data this test's folder, with `extra` flags at its end."""
    run_file = next(Path(v.split(":")[0]) for v in services["job"]["volumes"] if "/etc/slipstream/run.flags" in v)
    flags = tmp_path / "run.flags"
    flags.write_text((COMPOSE / run_file).read_text().replace("/data", str(data)) + extra)
    return flags


def check_commands(services: dict, flags: Path, data: Path, tmp_path: Path):
    """Each slipstream container's command line run here with `--check`: (name, the finished process)."""
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("slipstream") or service.get("entrypoint") not in (
            None,
            ["slipstream"],
        ):
            continue
        args = [a.replace("@/etc/slipstream/run.flags", f"@{flags}").replace("/data", str(data))
                for a in service["command"]]  # fmt: skip
        args = [a.replace("/runs", str(tmp_path / "runs")) for a in args]
        yield name, subprocess.run([sys.executable, "-m", "services", *args, "--check"], capture_output=True,
                                   text=True, cwd=tmp_path, timeout=120)  # fmt: skip


def write_data(form: str, data: Path) -> None:
    for item in FORMS[form][2]:  # what the run file names, so that the checks of files pass
        target = data / item
        if target.suffix == ".jsonl":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text('{"prompt": "1 + 1", "label": "2"}\n')
        else:
            write_tiny_model(target)


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
def test_the_stack_refuses_a_contradiction_in_its_run_file_as_slipstream_train_does(tmp_path):
    """A cross-service rule holds wherever a service loads its settings: each container that takes the weight-sync
    flags from the run file refuses them in the sentence `slipstream train --check` gives; the others start."""
    data = tmp_path / "data"
    write_data("cpu", data)
    services = render("cpu", data)["services"]
    flags = run_flags(services, data, tmp_path, "--update-weight-transport broadcast --update-weight-mode delta\n")
    sentence = (
        "--update-weight-mode delta: broadcast sends whole weights; use --update-weight-transport auto or streamed"
    )
    refused = set()
    for name, result in check_commands(services, flags, data, tmp_path):
        if result.returncode:
            assert sentence in result.stderr, f"{name}: {result.stderr}"
            refused.add(name)
    assert refused == {"rollout", "job"}  # the gateway, and the job's trainer (slipstream train joining the rest)


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_container_command_line_is_accepted(form, tmp_path):
    data = tmp_path / "data"
    write_data(form, data)
    config = render(form, data)
    services = config["services"]
    assert {"redis", "buffer", "reward", "rollout", "engine-0", "job"} <= set(services)
    redis_command = " ".join(services["redis"]["command"])
    assert "requirepass $(cat /run/secrets/redis_password)" in redis_command and "--appendonly yes" in redis_command
    for name in ("buffer", "rollout", "job"):  # Redis's password reaches them as a file, never on a command line
        assert services[name]["secrets"] == ["redis_password"]
        assert "/run/secrets/redis_password" in services[name]["command"] and "@redis:" not in str(services[name])
    flags = run_flags(services, data, tmp_path)
    checked = []
    for name, result in check_commands(services, flags, data, tmp_path):
        assert result.returncode == 0, f"{name}: {result.stderr}"
        checked.append(name)
    expected = {"buffer", "reward", "rollout", "job", "receiver-0"} | ({"engine-0"} if form == "cpu" else set())
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
        assert engine["ipc"] == "host" and "s/^--sglang-/--/p" in " ".join(engine["entrypoint"])
        assert services["job"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
        sglang_command_line_is_accepted(engine, flags, tmp_path)
    else:
        assert "deploy" not in services["engine-0"] and "deploy" not in services["job"]


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_engine_has_its_weight_receiver_beside_it(form, tmp_path):
    """receiver-N runs beside engine-N as a container of its pod: both in the namespaces engine-N-pod holds (the name
    engine-N: the gateway finds the receiver there on the engine's port + --weight-receiver-port-offset, the receiver
    its engine at 127.0.0.1), on the engine's GPU and IPC namespace (the host's), or on the CPU the same /dev/shm."""
    services = render(form, tmp_path)["services"]
    gateway = services["rollout"]["command"]
    offset = int(gateway[gateway.index("--weight-receiver-port-offset") + 1])
    engines = sorted(name for name in services if name.startswith("engine-") and not name.endswith("-pod"))
    assert engines
    for engine_name in engines:
        index = engine_name.removeprefix("engine-")
        engine, receiver, pod = services[engine_name], services[f"receiver-{index}"], services[f"{engine_name}-pod"]
        assert engine_name in pod["networks"]["slipstream"]["aliases"] and "networks" not in engine
        assert engine["network_mode"] == receiver["network_mode"] == f"service:engine-{index}-pod"
        args = receiver["command"]
        assert args[0] == "receiver" and args[args.index("--engine-url") + 1] == "http://127.0.0.1:30000"
        assert int(args[args.index("--port") + 1]) == 30000 + offset and args[args.index("--host") + 1] == "0.0.0.0"
        assert receiver["restart"] == engine["restart"] == pod["restart"] == "unless-stopped"
        if form == "cpu":
            shm = [v for v in engine["volumes"] if v.endswith(":/dev/shm")]
            assert shm and shm == [v for v in receiver["volumes"] if v.endswith(":/dev/shm")]
            assert args[args.index("--device") + 1] == "cpu" and receiver["environment"]["TMPDIR"] == "/dev/shm"
        else:
            gpus = [r["deploy"]["resources"]["reservations"]["devices"] for r in (engine, receiver)]
            assert gpus[0] == gpus[1] and args[args.index("--device") + 1] == "cuda"
            assert engine["ipc"] == receiver["ipc"] == "host"
            assert engine["pid"] == receiver["pid"] == f"service:engine-{index}-pod"


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
def test_under_mps_an_engine_and_its_receiver_share_their_gpus_daemon(tmp_path):
    """deploy/compose/mps.yml: a control daemon on each engine's GPU, in the engine's pod and the host's IPC namespace;
    the engine and its receiver find it through the pipes of one volume, and start once it answers."""
    services = render("mps", tmp_path)["services"]
    daemon, engine, receiver = services["mps-0"], services["engine-0"], services["receiver-0"]
    assert daemon["entrypoint"] == ["nvidia-cuda-mps-control", "-f"] and "get_server_list" in str(daemon["healthcheck"])
    gpus = [s["deploy"]["resources"]["reservations"]["devices"] for s in (daemon, engine, receiver)]
    assert gpus[0] == gpus[1] == gpus[2]
    assert daemon["ipc"] == engine["ipc"] == receiver["ipc"] == "host"
    assert daemon["pid"] == engine["pid"] == "service:engine-0-pod"
    pipes = daemon["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    for service in (daemon, engine, receiver):
        assert service is daemon or service["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipes
        assert f"mps-0:{pipes}" in [
            v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in service["volumes"]
        ]
    for service in (engine, receiver):
        assert service["depends_on"]["mps-0"]["condition"] == "service_healthy"
        assert service["environment"]["NCCL_SOCKET_IFNAME"] == "eth0"  # the main file's settings stay
    assert "user" not in engine and "user" not in receiver  # one user (the images' root): MPS serves one a GPU


def sglang_command_line_is_accepted(engine: dict, flags: Path, tmp_path: Path) -> None:
    """The SGLang container's entrypoint runs for real (with `python3` printing its arguments): every option it passes
    is one of the pinned release's server options (services/rollout/sglang_server_args.txt, read from its sources)."""
    listed = (REPO / "services" / "rollout" / "sglang_server_args.txt").read_text().splitlines()
    release = listed[0].split("sglang-")[1].split("-")[0]
    assert engine["image"].split(":v")[1].startswith(release + "-"), (engine["image"], release)  # the same release
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    with_gateways = tmp_path / "run.flags"  # the gateway's own --sglang-server-concurrency stays with the gateway
    with_gateways.write_text(flags.read_text() + "\n--sglang-server-concurrency 64\n")
    script = engine["entrypoint"][-1].replace("/etc/slipstream/run.flags", str(with_gateways))
    argv = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                          env={"PATH": f"{fake.parent}:/usr/bin:/bin"}).stdout.split()  # fmt: skip
    assert argv[:2] == ["-m", "sglang.launch_server"] and "--mem-fraction-static" in argv, argv
    assert "--server-concurrency" not in argv
    unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in listed]
    assert not unknown, f"not options of SGLang {release}: {unknown}"


@pytest.mark.skipif(TOOL is None, reason="needs podman-compose (with podman) or docker compose")
def test_the_compose_redis_takes_its_password_from_the_secret_and_shows_it_nowhere(tmp_path):
    """The redis service's command from the rendered compose file, run for real in a redis:7 container with the
    secret mounted where compose mounts it."""
    service = render("cpu", tmp_path)["services"]["redis"]
    check_redis_password_from_file(service["command"], "/run/secrets/redis_password", tmp_path)
