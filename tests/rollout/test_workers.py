"""A rollout for real: a buffer, a reward service, two reference engines and the gateway; every group reaches the
buffer exactly once, with samples whose tokens, log-probs and spans line up."""

import json
import time

import grpc
import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import build as build_buffer
from services.reward.config import RewardConfig
from services.reward.server import build as build_reward
from services.rollout.config import RolloutConfig
from services.rollout.server import build as build_rollout
from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc

NUM_PROMPTS = 24


@pytest.fixture
def system(grpc_service, channel_to, redis_url, tiny_model, start_engine, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(NUM_PROMPTS))
    )
    buffer = grpc_service(build_buffer, BufferConfig(
        prompt_data=str(data), label_key="label", hf_checkpoint=str(tiny_model), num_data_workers=0, num_epoch=1,
        rollout_batch_size=4, n_samples_per_prompt=2, max_staleness=100, redis={"url": redis_url, "prefix": "roll"},
    ))  # fmt: skip
    reward = grpc_service(build_reward, RewardConfig(rm_type="random", num_workers=1))
    engines = [start_engine(), start_engine()]
    gateway = grpc_service(build_rollout, RolloutConfig(
        engine_urls=engines, buffer_addr=buffer.address, reward_addr=reward.address, rollout_max_response_len=8,
        rollout_concurrency=8, rollout_health_check_interval=0.5,
    ))  # fmt: skip
    return (
        buffer_pb2_grpc.BufferServiceStub(channel_to(buffer.address)),
        rollout_pb2_grpc.RolloutServiceStub(channel_to(gateway.address)),
    )


def test_every_group_reaches_the_buffer_exactly_once(system):
    buffer, gateway = system
    assert gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10).started
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
        if state.counters["completed"] == NUM_PROMPTS:
            break
        time.sleep(0.2)
    gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    state = buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
    assert state.counters["completed"] == state.counters["started"] == NUM_PROMPTS
    assert state.counters.get("duplicate_submits", 0) == 0 and state.num_leased_groups == 0
    seen = []
    for step in range(NUM_PROMPTS // 4):
        batch = buffer.GetBatch(buffer_pb2.GetBatchRequest(step=step, dp_size=1, timeout_seconds=5), timeout=30)
        for group in batch.groups:
            seen.append(group.group_id)
            assert len(group.samples) == 2
            for sample in group.samples:
                tokens = samples.decode_tokens(sample.tokens)
                assert tokens[: sample.prompt_length].tolist() == samples.decode_tokens(group.prompt_tokens).tolist()
                assert len(tokens) == sample.prompt_length + sample.response_length
                assert len(samples.decode_logprobs(sample.rollout_logprobs)) == sample.response_length
                assert (samples.decode_logprobs(sample.rollout_logprobs) <= 0).all()
                assert sample.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
                assert [(s.version, s.start, s.end) for s in sample.weight_versions] == [
                    ("default", 0, sample.response_length)
                ]
                assert sample.reward in (0.0, 1.0) and sample.engine_url
        buffer.CommitBatch(buffer_pb2.CommitBatchRequest(step=step), timeout=10)
    assert len(seen) == len(set(seen)) == NUM_PROMPTS


def test_start_twice_and_unimplemented_parts(system):
    _, gateway = system
    assert gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10).started
    assert not gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10).started
    gateway.StopRollout(rollout_pb2.StopRolloutRequest(abort_in_flight=True), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        gateway.Evaluate(rollout_pb2.EvaluateRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
