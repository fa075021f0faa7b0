"""Rollout fixtures: a tiny Qwen3 checkpoint and real `slipstream engine` processes serving it."""

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import build as build_buffer
from services.common.processes import free_port, free_port_pair
from services.reward.config import RewardConfig
from services.reward.server import build as build_reward
from services.rollout.config import RolloutConfig
from services.rollout.server import build as build_rollout
from services.train.tiny_checkpoint import write_tiny_model
from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


def weights_of(url: str, name: str):
    """An engine's tensor `name` (its checkpoint name), whole."""
    import torch

    values = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**9}, timeout=30).json()
    return torch.tensor(values)


def wait_healthy(proc, url: str) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            pytest.fail(f"engine exited with {proc.proc.returncode}:\n{proc.log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"engine never became healthy:\n{proc.log}")


@pytest.fixture(scope="module")
def engine_url(tiny_model, tmp_path_factory):
    """One real engine process shared by a test module (starting one costs seconds)."""
    from tests.conftest import ServiceProcess

    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = ServiceProcess(["engine", "--model-path", str(tiny_model), "--port", str(port)], log, log.parent)
    try:
        yield wait_healthy(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.stop()


@pytest.fixture
def start_engine(service_process, free_port, tiny_model):
    """`url = start_engine()`: a real engine process of its own on a free port (or `port=`), ready (/health answered
    200); `start_engine.procs[url]` is its process. `module="tests.rollout.faulty_engine"` starts a faulty one."""

    def start(*args: str, port: int | None = None, module: str = "services") -> str:
        return many([args], [port], module)[0]

    def many(args: list, ports: list, module: str = "services") -> list[str]:
        """`start_engine.many([args, ...], [port, ...])`: several engines at once (their start-ups overlap)."""
        ports = [port or free_port() for port in ports]
        procs = [service_process("engine", "--model-path", str(tiny_model), "--port", str(port), *a, module=module)
                 for a, port in zip(args, ports, strict=True)]  # fmt: skip
        urls = [wait_healthy(proc, f"http://127.0.0.1:{port}") for proc, port in zip(procs, ports, strict=True)]
        start.procs.update(zip(urls, procs, strict=True))
        return urls

    start.procs, start.many = {}, many
    return start


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The same tiny model in this process, for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-ref"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


NUM_PROMPTS = 24


@dataclass
class System:
    """A buffer, a reward service, reference engines and the gateway; stubs to the first two services."""

    buffer: object
    gateway: object
    thread: object  # the gateway's ServiceThread: `run(coro)` runs on its loop
    engines: list[str]
    buffer_address: str = ""
    buffer_service: object = None  # its ServiceThread (`.server.service.config` to start it again)

    def __iter__(self):
        return iter((self.buffer, self.gateway, self))

    @property
    def rollout(self):
        return self.thread.server.service.servicers[0].impl.rollout

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.thread.loop).result(timeout)


@pytest.fixture
def make_system(grpc_service, channel_to, redis_url, tiny_model, start_engine, service_process, tmp_path):
    """`make_system(num_engines=2, buffer={...}, reward={...}, num_prompts=24, receivers=False, **gateway_settings)`:
    every part real; prompts "What is i + 1?" with labels, and the eval set "arith" (the first 6 prompts).
    `receivers`: a weight receiver beside each engine, through which weight syncs stream; `disk`: the folder weight
    syncs go through (--update-weight-transport disk)."""

    def make(num_engines: int = 2, buffer: dict | None = None, reward: dict | None = None, model=tiny_model,
             num_prompts: int = NUM_PROMPTS, receivers: bool = False, disk: Path | None = None,
             **gateway) -> System:  # fmt: skip
        data = tmp_path / "prompts.jsonl"
        rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(num_prompts)]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        # The run's facts, the same for every service (as a run file gives them): services/common/run_facts.py
        facts = {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "rm_type": "random"}
        facts |= {k: v for k, v in {**(buffer or {}), **(reward or {})}.items() if k in facts}
        buffer_service = grpc_service(build_buffer, BufferConfig(**{
            "prompt_data": str(data), "label_key": "label", "hf_checkpoint": str(model), "num_data_workers": 0,
            "num_epoch": 1, "max_staleness": 100, "redis": {"url": redis_url, "prefix": f"roll{uuid.uuid4().hex[:8]}"},
            "eval_prompt_data": ["arith", f"{data}@[0:6]"], **facts, **(buffer or {}),
        }))  # fmt: skip
        reward_service = grpc_service(build_reward, RewardConfig(**{"num_workers": 1, **facts, **(reward or {})}))
        # Engine i on "GPU" i: colocated, it reads the tensor handles of trainer rank i.
        ports = [free_port_pair() if receivers else None for _ in range(num_engines)]
        loads = ("--weight-disk-dir", str(disk)) if disk else ()
        engines = start_engine.many([("--model-path", str(model), "--base-gpu-id", str(i), *loads)
                                     for i in range(num_engines)], ports)  # fmt: skip
        if disk:  # the trainer's checkpoint per sync, loaded from there
            gateway["update_weight_disk_dir"] = str(disk)
        if receivers:  # beside each engine, on its port + 1: the weights stream through them
            procs = [service_process("receiver", "--engine-url", url, "--port", str(port + 1), "--timeout-s", "60")
                     for url, port in zip(engines, ports, strict=True)]  # fmt: skip
            for proc, port in zip(procs, ports, strict=True):
                wait_healthy(proc, f"http://127.0.0.1:{port + 1}")
            gateway["weight_receiver_port_offset"] = 1
        thread = grpc_service(build_rollout, RolloutConfig(**{
            "engine_urls": engines, "buffer_addr": buffer_service.address, "reward_addr": reward_service.address,
            "rollout_max_response_len": 8, "rollout_concurrency": 8, "rollout_health_check_interval": 0.5, **facts,
            **gateway,
        }))  # fmt: skip
        return System(
            buffer_pb2_grpc.BufferServiceStub(channel_to(buffer_service.address)),
            rollout_pb2_grpc.RolloutServiceStub(channel_to(thread.address)),
            thread,
            engines,
            buffer_service.address,
            buffer_service,
        )

    return make


@pytest.fixture
def system(make_system) -> System:
    return make_system()


def wait_completed(buffer, count: int, timeout_s: float = 180) -> buffer_pb2.BufferState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
        if state.counters["completed"] >= count:
            return state
        time.sleep(0.2)
    pytest.fail(f"only {state.counters['completed']} of {count} groups completed")


def get_batch(buffer, step: int, timeout_s: float = 5) -> buffer_pb2.GetBatchResponse:
    """Step `step`'s batch as the trainer takes it: the groups with their arrays put back."""
    request = buffer_pb2.GetBatchRequest(step=step, dp_size=1, timeout_seconds=timeout_s)
    batch = buffer.GetBatch(request, timeout=timeout_s + 30)
    samples.put_batch_arrays(batch.groups, batch.arrays)
    return batch


def gateway_address(proc) -> str:
    """The address of a gateway process started on port 0, from its log."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"rollout serving on [^:]+:(\d+)", proc.log)
        if match:
            return f"127.0.0.1:{match[1]}"
        if proc.proc.poll() is not None:
            pytest.fail(f"the gateway exited with {proc.proc.returncode}:\n{proc.log}")
        time.sleep(0.2)
    pytest.fail(f"the gateway did not start:\n{proc.log}")


def start_rollout(proc) -> bool:
    with grpc.insecure_channel(gateway_address(proc)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30, wait_for_ready=True).started


def assert_groups_come_back(system: System) -> None:
    """Runs the rollout until three groups went back to the buffer, stops it, and checks that none was submitted
    and every started group is pending again (none lost)."""
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    deadline = time.monotonic() + 60
    while system.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10).counters["released"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=60)
    state = system.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
    assert state.counters.get("completed", 0) == 0 and state.num_leased_groups == 0
    assert state.num_pending_prompts == state.counters["started"]
