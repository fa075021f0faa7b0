"""`make deploy-check`: the compose stack for real, through whatever engine DOCKER_HOST names. Builds the images,
starts docker-compose.yml + cpu.yml (the demo task on the CPU), kills the buffer's container and the engine's
mid-run (their restart policy and Redis's AOF bring them back), and checks that the job learns and exits 0, that no
step was lost or trained twice, that every weight sync went through the engine's weight receiver (the streamed path),
that both reward replicas scored, and that `down` leaves nothing. Before that, it starts reward-external.yml's judges
and scores through each. The last lines it prints are the job's summary.

    python deploy/compose/check.py     (what `make deploy-check` runs)
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROJECT = "slipstream-check"
ENGINE = shutil.which("podman") or "docker"
TOOL = [sys.executable, "-m", "podman_compose"] if "podman" in ENGINE else ["docker", "compose"]
COMPOSE = [*TOOL, "-p", PROJECT, "--env-file", str(HERE / "cpu.env"), "-f", str(HERE / "docker-compose.yml"), "-f",
           str(HERE / "cpu.yml")]  # fmt: skip
EXTERNAL = [*COMPOSE, "-f", str(HERE / "reward-external.yml")]
STEPS = 150
# Run inside a reward container: one Score call per external judge, a right and a wrong answer each.
PROBE = """
import time
import grpc
from services.common.clients import open_channel
from slipstream.v1 import reward_pb2 as pb, reward_pb2_grpc
stub, found = reward_pb2_grpc.RewardServiceStub(open_channel("localhost:50053")), {}
items = [pb.RewardItem(item_id="right", response=b"so 7", label="7"),
         pb.RewardItem(item_id="wrong", response=b"3", label="7")]
deadline = time.monotonic() + 120
while len(found) < 2 and time.monotonic() < deadline:  # the judges may still be starting
    for rm_type in {"remote_grpc", "remote_rm"} - set(found):
        try:  # the reward service itself may be starting too
            results = stub.Score(pb.ScoreRequest(items=items, rm_type=rm_type), timeout=60).results
        except grpc.RpcError:
            continue
        if not any(r.error for r in results):
            found[rm_type] = [round(r.reward, 3) for r in results]
    time.sleep(1)
print(found)
"""


def sh(*args: str, check: bool = True, quiet: bool = True, stdin: str | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, input=stdin)
    if check and result.returncode:
        raise SystemExit(f"deploy-check: {' '.join(args[:4])}… failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    if not quiet:
        print(result.stdout, end="")
    return result.stdout


def container(service: str, replica: int = 1) -> str:
    return f"{PROJECT}_{service}_{replica}" if "podman" in ENGINE else f"{PROJECT}-{service}-{replica}"


def items_scored(replica: int) -> float:
    """What one reward replica scored, from its Prometheus counter (read inside its container)."""
    probe = "import urllib.request as u; print(u.urlopen('http://localhost:9103/metrics').read().decode())"
    out = sh(ENGINE, "exec", container("reward", replica), "python", "-c", probe, check=False)
    return sum(float(line.split()[-1]) for line in out.splitlines() if line.startswith("slipstream_reward_items_total"))


def in_runs(command: str) -> str:
    """What `command` prints in a container that mounts the runs volume (at /runs)."""
    return sh(ENGINE, "run", "--rm", "-v", f"{PROJECT}_runs:/runs", "--entrypoint", "sh", "redis:7", "-c", command,
              check=False)  # fmt: skip


def steps() -> list[dict]:
    """The job's steps.jsonl."""
    out = in_runs("cat /runs/demo/steps.jsonl")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def syncs_by_transport() -> dict[str, int]:
    """The trainer's weight syncs by transport, from its log in the run folder ("weights of version N sent to K
    engine(s) (streamed)": through the receivers)."""
    out = in_runs("cat /runs/demo/logs/trainer*.log")
    found = re.findall(r"weights of version \d+ sent to [1-9]\d* engine\(s\) \((\w+)\)", out)
    return {transport: found.count(transport) for transport in sorted(set(found))}


def wait_for_step(step: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps()) <= step:
        state = sh(ENGINE, "inspect", container("job"), "--format", "{{.State.Status}}", check=False).strip()
        if state == "exited" or time.monotonic() > deadline:
            raise SystemExit(f"deploy-check: the job stopped before step {step} ({state}):\n"
                             + sh(ENGINE, "logs", "--tail", "30", container("job"), check=False))  # fmt: skip
        time.sleep(2)


def kill(service: str) -> None:
    """SIGKILL of the container's main process from the host, as a crash (`docker kill` would count as a stop that
    the restart policy respects)."""
    pid = int(sh(ENGINE, "inspect", container(service), "--format", "{{.State.Pid}}").strip())
    print(f"deploy-check: kill -9 of the {service} container's process at step {len(steps())}", flush=True)
    os.kill(pid, signal.SIGKILL)


def external_reward() -> str:
    """reward-external.yml: the reward service in front of the two example judges, asked for a score through each.
    Returns what went wrong, or ""."""
    try:
        sh(*EXTERNAL, "up", "-d", "judge", "judge-http", "reward")
        found = sh(ENGINE, "exec", "-i", container("reward"), "python", "-", stdin=PROBE, check=False).strip()
    finally:
        sh(*EXTERNAL, "down", "-v", check=False)
    print(f"deploy-check: reward-external.yml: the judges scored a right and a wrong answer: {found}", flush=True)
    expected = ("'remote_grpc': [1.0", "'remote_rm': [1.0, 0.0]")
    return "" if all(e in found for e in expected) else f"the external judges answered {found or 'nothing'}"


def redis_password() -> None:
    """The compose secret with Redis's password (cpu.env names it), made once; the buffer's container user (nobody)
    reads it through its bind mount."""
    path = HERE / "redis-password"
    if not path.exists():
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o644)


def main() -> int:
    started = time.monotonic()
    print(sh(str(REPO / "deploy/images/build.sh"), "cpu"), end="", flush=True)
    redis_password()
    if not (HERE / "demo" / "model" / "config.json").exists():  # the demo's model and data, written by the image
        (HERE / "demo").mkdir(exist_ok=True)
        sh(ENGINE, "run", "--rm", "-v", f"{HERE / 'demo'}:/data", "slipstream-torch:cpu", "demo", "--prepare-only",
           "--output-dir", "/data")  # fmt: skip
    sh(*EXTERNAL, "down", "-v", check=False)
    problems = [p for p in [external_reward()] if p]
    try:
        sh(*COMPOSE, "up", "-d")
        wait_for_step(30)
        kill("buffer")
        wait_for_step(60)
        kill("engine-0")
        code = sh(ENGINE, "wait", container("job"), check=False).strip()
        logs = sh(ENGINE, "logs", container("job"), check=False)
        trained = steps()
        syncs = syncs_by_transport()
        scored = [items_scored(replica) for replica in (1, 2)]
    finally:
        sh(*COMPOSE, "down", "-v", check=False)
    left = sh(ENGINE, "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.Names}}")
    left += sh(ENGINE, "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}", "--format", "{{.Names}}")
    if code != "0":
        problems.append(f"the job exited with {code}")
    if [s["step"] for s in trained] != list(range(STEPS)):
        problems.append(f"steps {[s['step'] for s in trained][:5]}… are not 0..{STEPS - 1} once each")
    groups = [g for s in trained for g in s["groups"]]
    if len(groups) != len(set(groups)):
        problems.append("a prompt group was trained twice")
    rewards = [s["metrics"]["reward"] for s in trained] or [0.0]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    if not (first <= 0.2 and last >= 0.8):
        problems.append(f"the reward went from {first:.3f} to {last:.3f}, not from <= 0.2 to >= 0.8")
    if set(syncs) != {"streamed"} or syncs["streamed"] < STEPS // 2:
        problems.append(f"the weight syncs went {syncs or 'nowhere'}, not all streamed through the receiver")
    if not all(scored):
        problems.append(f"the reward replicas scored {scored} items: the gateway did not spread its calls")
    if left.strip():
        problems.append(f"containers left after down: {left.split()}")
    print(f"deploy-check: {'FAILED: ' + '; '.join(problems) if problems else 'passed'} "
          f"({time.monotonic() - started:.0f} s; reward {first:.3f} -> {last:.3f}; the buffer and the engine were "
          f"killed mid-run; weight syncs by transport: {syncs}; items scored by each reward replica: "
          f"{scored})")  # fmt: skip
    summary = logs[logs.rfind("trained steps") :] if "trained steps" in logs else logs[-2000:]
    print(summary.rstrip())
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PODMAN_COMPOSE_WARNING_LOGS", "false")
    # podman-compose resolves a secret's relative file from its working folder, docker compose from the project's
    os.environ["COMPOSE_PROJECT_DIR"] = str(HERE)
    sys.exit(main())
