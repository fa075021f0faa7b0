"""Engines and the router started by the gateway itself (`--rollout-num-gpus`, `--use-router`): reference engines
on this CPU machine, generation through a real sglang-router, and every child gone when the gateway stops."""

import re

import httpx
import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import build as build_buffer
from services.reward.config import RewardConfig
from services.reward.server import build as build_reward
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.rollout.conftest import NUM_PROMPTS, gateway_address, wait_completed


@pytest.fixture
def services(grpc_service, redis_url, tiny_model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "Count to {i}"}}\n' for i in range(NUM_PROMPTS)))
    buffer = grpc_service(build_buffer, BufferConfig(
        prompt_data=str(data), hf_checkpoint=str(tiny_model), num_data_workers=0, num_epoch=1, rollout_batch_size=4,
        n_samples_per_prompt=2, max_staleness=100, redis={"url": redis_url, "prefix": "launch"},
    ))  # fmt: skip
    reward = grpc_service(build_reward, RewardConfig(rm_type="random", num_workers=1))
    return ["--buffer-addr", buffer.address, "--reward-addr", reward.address, "--port", "0", "--metrics-port", "null"]


def test_gateway_launches_engines_and_routes_through_the_router(services, service_process, tiny_model, tmp_path,
                                                                channel_to):  # fmt: skip
    proc = service_process("rollout", *services, "--rollout-num-gpus", "2", "--hf-checkpoint", str(tiny_model),
                           "--use-router", "--engine-log-dir", str(tmp_path / "engines"),
                           "--rollout-max-response-len", "8", "--sglang-max-running-requests", "16")  # fmt: skip
    gateway = rollout_pb2_grpc.RolloutServiceStub(channel_to(gateway_address(proc)))
    engines = gateway.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10, wait_for_ready=True).engines
    assert len(engines) == 2 and all(e.state == rollout_pb2.ENGINE_STATE_HEALTHY for e in engines)
    assert all(e.model_path == str(tiny_model) for e in engines)
    gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)
    buffer = buffer_pb2_grpc.BufferServiceStub(channel_to(services[1]))
    state = wait_completed(buffer, NUM_PROMPTS)
    assert state.counters["completed"] == NUM_PROMPTS
    router_port = re.search(r"router starting on port (\d+)", proc.log)[1]
    batch = buffer.GetBatch(buffer_pb2.GetBatchRequest(step=0, dp_size=1, timeout_seconds=5), timeout=30)
    assert {s.engine_url for g in batch.groups for s in g.samples} == {f"http://127.0.0.1:{router_port}"}
    assert proc.terminate(timeout_s=60) == 0
    for engine in engines:  # the engines and the router stopped with the gateway
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{engine.url}/health", timeout=5)


def test_an_engine_that_cannot_start_stops_the_gateway_with_its_log(services, service_process, tiny_model, tmp_path):
    proc = service_process("rollout", *services, "--rollout-num-gpus", "1", "--hf-checkpoint", str(tiny_model),
                           "--engine-log-dir", str(tmp_path / "e"), "--sglang-enable-memory-saver")  # fmt: skip
    assert proc.wait(timeout_s=120) != 0
    assert "engine-0 exited with code" in proc.log and "engine-0.log" in proc.log
    assert "unknown option --enable-memory-saver" in proc.log


def test_launch_settings_are_checked_first(service_process, tmp_path):
    proc = service_process("rollout", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2")
    assert proc.wait() != 0
    assert "rollout_num_gpus 3 is not a multiple of rollout_num_gpus_per_engine 2" in proc.log
    assert "Traceback" not in proc.log


def test_a_launched_receiver_reads_the_engines_key_from_its_file(tmp_path):
    """The key is on no command line (any local user can read those): the receiver is given the file, and checks the
    key the gateway sends with the same file."""
    from services.rollout.config import RolloutConfig
    from services.rollout.launch import receiver_command

    (key := tmp_path / "engine-api-key").write_text("k3y-0123456789\n")
    config = RolloutConfig(engine_api_key_file=key, weight_receiver_port_offset=1)
    args = receiver_command(config, 30000, 1, False, 0)
    assert "k3y-0123456789" not in " ".join(args)
    assert args[args.index("--engine-api-key-file") + 1] == args[args.index("--api-key-file") + 1] == str(key)
