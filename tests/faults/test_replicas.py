"""A run whose services are several processes each, on one Redis: three buffer replicas, two reward replicas and two
gateways (a fleet: a shared engine registry, each engine generated on by one gateway, the coordinator running the
weight syncs), reached through `ipv4:` targets (gRPC's round robin, as `dns:///` targets are on a cluster). One
buffer, one reward replica and the gateway that is not the coordinator are SIGKILLed mid-run; the run finishes, every
prompt group is trained exactly once, the buffer's record agrees, and every weight sync reaches both engines."""

import os
import secrets
import signal

import redis

from services.common.auth import ROLES
from services.common.processes import free_port
from services.common.redis_connection import EmbeddedRedis
from services.train.demo import train_args
from services.train.options import route
from tests.faults.test_faults import SAVE_INTERVAL, STEPS, check_invariants, wait_for_step
from tests.test_train import steps_of, wait_gone


def test_replicas_of_each_service_lose_one_each_and_every_prompt_is_trained_once(
    service_process, tmp_path, wait_serving
):
    server = EmbeddedRedis(tmp_path / "redis").start()
    tokens = tmp_path / "auth-tokens"
    tokens.write_text("".join(f"{role} {secrets.token_hex(16)}\n" for role in ROLES))
    tokens.chmod(0o600)
    args = [*train_args(tmp_path, steps=STEPS), "--save-interval", str(SAVE_INTERVAL), "--stall-timeout-s", "120",
            "--lease-seconds", "20", "--rollout-health-check-interval", "1", "--fleet-ttl-s", "3"]  # fmt: skip
    model = args[args.index("--hf-checkpoint") + 1]
    shared = ["--host", "127.0.0.1", "--metrics-port", "null", "--auth-token-file", str(tokens)]
    routed = route(args)
    engines = []
    for _ in range(2):
        port = free_port()
        engines.append(service_process("engine", "--model-path", model, "--host", "127.0.0.1", "--port", str(port)))
        engines[-1].url = f"http://127.0.0.1:{port}"
    found: dict[str, list] = {"buffer": [], "reward": [], "rollout": []}

    def start(name: str, count: int, own: list[str]) -> None:
        for _ in range(count):
            port = free_port()
            proc = service_process(name, *routed[name], *shared, *own, "--port", str(port))
            found[name].append((f"127.0.0.1:{port}", proc))
            wait_serving(found[name][-1][0], proc, timeout_s=180)

    def target(name: str) -> str:
        return "ipv4:" + ",".join(address for address, _ in found[name])

    start("buffer", 3, ["--redis-url", server.url])
    start("reward", 2, [])
    start("rollout", 2, ["--redis-url", server.url, "--buffer-addr", target("buffer"), "--reward-addr",
                         target("reward"), "--engine-urls", *(e.url for e in engines)])  # fmt: skip
    run_dir = tmp_path / "demo"
    try:
        run = service_process("train", *args, "--buffer-addr", target("buffer"), "--reward-addr", target("reward"),
                              "--rollout-addr", target("rollout"), "--redis-url", server.url, "--auth-token-file",
                              str(tokens))  # fmt: skip
        wait_for_step(run, run_dir, 3)
        coordinator = redis.Redis.from_url(server.url).get("slipstream:{demo}:fleet:coordinator").decode()
        gateway = next(proc for address, proc in found["rollout"] if address != coordinator)
        for proc in (found["buffer"][1][1], found["reward"][1][1], gateway):
            os.kill(proc.proc.pid, signal.SIGKILL)
        assert run.wait(600) == 0, run.log[-3000:]
        assert wait_gone(run_dir, timeout_s=60) == []
        check_invariants(run_dir, [steps_of(run_dir)], server.url)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        for version in range(1, STEPS + 1):
            assert f"weights of version {version} sent to 2 engine(s)" in trainer_log, trainer_log[-3000:]
    finally:
        server.stop()
