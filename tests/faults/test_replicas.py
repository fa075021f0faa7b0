"""Runs whose services are several processes each, on one Redis: buffer, reward and gateway replicas (the gateways a
fleet: a shared engine registry, each engine generated on by one gateway, the coordinator running the weight syncs),
reached through `ipv4:` targets (gRPC's round robin, as `dns:///` targets are on a cluster).

- Three buffers, two reward replicas and two gateways train a run; one buffer, one reward replica and the gateway that
  is not the coordinator are SIGKILLed mid-run; the run finishes, every prompt group is trained exactly once, the
  buffer's record agrees, and every weight sync reaches both engines.
- The coordinator is SIGKILLed in the middle of a weight sync: the trainer starts the sync over, the other gateway
  takes the coordinator's lease and runs it, and both engines get the weights and generate again."""

import os
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import redis
import torch
from safetensors.torch import load_file

from services.common.auth import ROLES
from services.common.config import AuthConfig, TlsConfig
from services.common.processes import free_port
from services.common.redis_connection import EmbeddedRedis
from services.train.demo import train_args
from services.train.options import route
from services.trainer.weight_sync import WeightSender
from tests.faults.test_faults import SAVE_INTERVAL, STEPS, check_invariants, wait_for_step
from tests.test_train import steps_of, wait_gone


@dataclass
class Fleet:
    """The replicas of each service, (address, process) each, on the Redis at `redis_url`."""

    args: list[str]
    tokens: Path
    redis_url: str
    engines: list[str] = field(default_factory=list)
    found: dict[str, list] = field(default_factory=lambda: {"buffer": [], "reward": [], "rollout": []})

    def target(self, name: str) -> str:
        return "ipv4:" + ",".join(address for address, _ in self.found[name])

    def coordinator(self) -> str:
        return redis.Redis.from_url(self.redis_url).get("slipstream:{demo}:fleet:coordinator").decode()

    def gateway(self, address: str):
        return next(proc for at, proc in self.found["rollout"] if at == address)


def start_fleet(service_process, wait_serving, tmp_path: Path, redis_url: str, counts: dict[str, int]) -> Fleet:
    tokens = tmp_path / "auth-tokens"
    tokens.write_text("".join(f"{role} {secrets.token_hex(16)}\n" for role in ROLES))
    tokens.chmod(0o600)
    args = [*train_args(tmp_path, steps=STEPS), "--save-interval", str(SAVE_INTERVAL), "--stall-timeout-s", "120",
            "--lease-seconds", "20", "--rollout-health-check-interval", "1", "--fleet-ttl-s", "3"]  # fmt: skip
    fleet = Fleet(args, tokens, redis_url)
    model = args[args.index("--hf-checkpoint") + 1]
    shared = ["--host", "127.0.0.1", "--metrics-port", "null", "--auth-token-file", str(tokens)]
    routed = route(args)
    for _ in range(2):
        port = free_port()
        service_process("engine", "--model-path", model, "--host", "127.0.0.1", "--port", str(port))
        fleet.engines.append(f"http://127.0.0.1:{port}")

    def start(name: str, own: list[str]) -> None:
        for _ in range(counts[name]):
            port = free_port()
            proc = service_process(name, *routed[name], *shared, *own, "--port", str(port))
            fleet.found[name].append((f"127.0.0.1:{port}", proc))
            wait_serving(fleet.found[name][-1][0], proc, timeout_s=180)

    start("buffer", ["--redis-url", redis_url])
    start("reward", [])
    start("rollout", ["--redis-url", redis_url, "--buffer-addr", fleet.target("buffer"), "--reward-addr",
                      fleet.target("reward"), "--engine-urls", *fleet.engines])  # fmt: skip
    return fleet


def test_replicas_of_each_service_lose_one_each_and_every_prompt_is_trained_once(
    service_process, tmp_path, wait_serving
):
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        fleet = start_fleet(service_process, wait_serving, tmp_path, server.url,
                            {"buffer": 3, "reward": 2, "rollout": 2})  # fmt: skip
        run_dir = tmp_path / "demo"
        run = service_process("train", *fleet.args, "--buffer-addr", fleet.target("buffer"), "--reward-addr",
                              fleet.target("reward"), "--rollout-addr", fleet.target("rollout"), "--redis-url",
                              server.url, "--auth-token-file", str(fleet.tokens))  # fmt: skip
        wait_for_step(run, run_dir, 3)
        coordinator = fleet.coordinator()
        gateway = next(proc for address, proc in fleet.found["rollout"] if address != coordinator)
        for proc in (fleet.found["buffer"][1][1], fleet.found["reward"][1][1], gateway):
            os.kill(proc.proc.pid, signal.SIGKILL)
        assert run.wait(600) == 0, run.log[-3000:]
        assert wait_gone(run_dir, timeout_s=60) == []
        check_invariants(run_dir, [steps_of(run_dir)], server.url)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        for version in range(1, STEPS + 1):
            assert f"weights of version {version} sent to 2 engine(s)" in trainer_log, trainer_log[-3000:]
    finally:
        server.stop()


def test_a_coordinator_killed_mid_sync_hands_the_sync_to_the_other_gateway(service_process, tmp_path, wait_serving,
                                                                           caplog):  # fmt: skip
    server = EmbeddedRedis(tmp_path / "redis").start()
    sender = None
    try:
        fleet = start_fleet(service_process, wait_serving, tmp_path, server.url,
                            {"buffer": 1, "reward": 1, "rollout": 2})  # fmt: skip
        model = Path(fleet.args[fleet.args.index("--hf-checkpoint") + 1])
        hf = {name: t.contiguous() for name, t in sorted(load_file(model / "model.safetensors").items())}
        config = SimpleNamespace(rollout_addr=fleet.target("rollout"), update_weight_buffer_size=int(0.05 * 2**20),
                                 update_weight_flattened_bucket=False, update_weight_mode="full",
                                 update_weight_transport="nccl", update_weight_buckets_in_flight=2, lora_rank=0,
                                 weight_sync_address="127.0.0.1", colocate=False, weight_sync_timeout_s=30,
                                 tls=TlsConfig(), auth=AuthConfig(token_file=fleet.tokens))  # fmt: skip
        sender = WeightSender(config, weights=None, sender=True)
        sender.weights = lambda: iter({n: t + 1 for n, t in hf.items()}.items())
        assert sender.sync(1)
        coordinator = fleet.coordinator()
        sent, passes = {n: t + 2 for n, t in hf.items()}, []

        def weights():  # the first pass kills the coordinator once a few buckets have gone out
            passes.append(len(passes))
            for index, (name, tensor) in enumerate(sent.items()):
                if len(passes) == 1 and index == len(sent) - 3:
                    os.kill(fleet.gateway(coordinator).proc.pid, signal.SIGKILL)
                yield name, tensor

        sender.weights = weights
        assert sender.sync(2)
        assert len(passes) == 2 and "starting over" in caplog.text
        assert fleet.coordinator() != coordinator
        for url in fleet.engines:  # every engine has the weights, and generates with them
            assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "2"
            for name in ("lm_head.weight", "model.norm.weight"):
                values = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**9},
                                    timeout=30).json()  # fmt: skip
                assert torch.equal(torch.tensor(values), sent[name])
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(f"{url}/generate", json=body, timeout=30).json()["meta_info"]["weight_version"] == "2"
    finally:
        if sender is not None:
            sender.close()
        server.stop()
