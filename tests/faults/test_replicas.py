"""A run whose buffer and reward services are several processes each, on one Redis: three buffer replicas and two
reward replicas behind `ipv4:` targets (gRPC's round_robin, as `dns:///` targets are on a cluster). One replica of
each is SIGKILLed mid-run; the run finishes, every prompt group is trained exactly once, the buffer's record agrees,
and every weight sync reaches both engines."""

import os
import secrets
import signal

from services.common.auth import ROLES
from services.common.processes import free_port
from services.common.redis_connection import EmbeddedRedis
from services.train.demo import train_args
from services.train.options import route
from tests.faults.test_faults import SAVE_INTERVAL, STEPS, check_invariants, wait_for_step
from tests.test_train import steps_of, wait_gone


def test_buffer_and_reward_replicas_lose_one_each_and_every_prompt_is_trained_once(
    service_process, tmp_path, wait_serving
):
    redis = EmbeddedRedis(tmp_path / "redis").start()
    tokens = tmp_path / "auth-tokens"
    tokens.write_text("".join(f"{role} {secrets.token_hex(16)}\n" for role in ROLES))
    tokens.chmod(0o600)
    args = [*train_args(tmp_path, steps=STEPS), "--save-interval", str(SAVE_INTERVAL), "--rollout-num-gpus", "2",
            "--stall-timeout-s", "120", "--lease-seconds", "20", "--rollout-health-check-interval", "1"]  # fmt: skip
    shared = ["--host", "127.0.0.1", "--metrics-port", "null", "--auth-token-file", str(tokens)]
    routed = route(args)
    replicas: dict[str, list] = {"buffer": [], "reward": []}
    for name, count, own in (("buffer", 3, ["--redis-url", redis.url]), ("reward", 2, [])):
        for _ in range(count):
            port = free_port()
            proc = service_process(name, *routed[name], *shared, *own, "--port", str(port))
            replicas[name].append((f"127.0.0.1:{port}", proc))
    for address, proc in replicas["buffer"] + replicas["reward"]:
        wait_serving(address, proc, timeout_s=120)
    target = {name: "ipv4:" + ",".join(address for address, _ in found) for name, found in replicas.items()}
    run_dir = tmp_path / "demo"
    try:
        run = service_process("train", *args, "--buffer-addr", target["buffer"], "--reward-addr", target["reward"],
                              "--redis-url", redis.url, "--auth-token-file", str(tokens))  # fmt: skip
        wait_for_step(run, run_dir, 3)
        for name in ("buffer", "reward"):
            os.kill(replicas[name][1][1].proc.pid, signal.SIGKILL)
        assert run.wait(600) == 0, run.log[-3000:]
        assert wait_gone(run_dir, timeout_s=60) == []
        check_invariants(run_dir, [steps_of(run_dir)], redis.url)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        for version in range(1, STEPS + 1):
            assert f"weights of version {version} sent to 2 engine(s)" in trainer_log, trainer_log[-3000:]
    finally:
        redis.stop()
