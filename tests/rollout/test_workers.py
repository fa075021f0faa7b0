"""A rollout for real: a buffer, a reward service, two reference engines and the gateway; every group reaches the
buffer exactly once, with samples whose tokens, log-probs and spans line up."""

import json
import signal
import time

import grpc
import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import build as build_buffer
from services.common.metrics import RPC_REQUESTS
from services.reward.config import RewardConfig
from services.reward.server import build as build_reward
from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2
from tests.rollout.conftest import NUM_PROMPTS, get_batch, start_rollout, wait_completed


def test_every_group_reaches_the_buffer_exactly_once(system):
    buffer, gateway, _ = system
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
        batch = get_batch(buffer, step, 5)
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


def test_group_rm_scores_each_group_in_one_call(make_system, tmp_path):
    judge = tmp_path / "judge.py"
    judge.write_text("def rank(args, samples):\n    return [float(i) for i in range(len(samples))]\n")
    system = make_system(num_engines=1, reward={"custom_rm_path": f"{judge}:rank", "group_rm": True}, group_rm=True)
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    wait_completed(system.buffer, 4)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    batch = get_batch(system.buffer, 0, 5)
    assert [[s.reward for s in g.samples] for g in batch.groups] == [[0.0, 1.0]] * 4  # the group function's ranks


@pytest.mark.parametrize("dynamic_filter", [None, "services.buffer.filters:check_reward_nonzero_std"])
def test_a_gateway_on_the_buffers_redis_moves_the_arrays_there_and_the_trainer_reads_them_there(
    make_system, redis_url, redis_client, dynamic_filter
):
    """The data plane: without a dynamic-sampling filter in the buffer, the gateway completes each training group in
    Redis itself (small arrays in the submit script's call, no SubmitGroup); with one, it uploads the arrays and
    submits the rest, the buffer's filter sees the group, and the submit script takes the upload over. Either way
    GetBatch hands out keys, and nothing is left behind."""
    renames = redis_client.info("commandstats").get("cmdstat_rename", {}).get("calls", 0)
    submits = RPC_REQUESTS.labels("buffer", "SubmitGroup", "OK")._value.get()
    system = make_system(num_engines=1, buffer={"dynamic_sampling_filter_path": dynamic_filter},
                         redis={"url": redis_url, "prefix": "dataplane"}, advertise_addr="127.0.0.1:9")  # fmt: skip
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    wait_completed(system.buffer, 4)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    uploaded = redis_client.info("commandstats").get("cmdstat_rename", {}).get("calls", 0) - renames
    submits = RPC_REQUESTS.labels("buffer", "SubmitGroup", "OK")._value.get() - submits
    state = system.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
    if dynamic_filter is None:
        assert submits == 0 and "dropped" not in state.counters
    else:
        assert submits >= 4  # (the server counts a call after answering it: the last may not be counted yet)
    ask = buffer_pb2.GetBatchRequest(step=0, dp_size=1, timeout_seconds=5, arrays_from_redis=True)
    batch = system.buffer.GetBatch(ask, timeout=30)
    assert (uploaded >= 4 or dynamic_filter is None) and len(batch.arrays_keys) == 4 and not batch.arrays
    samples.put_batch_arrays(batch.groups, redis_client.mget(batch.arrays_keys))
    for group in batch.groups:
        assert len({s.reward for s in group.samples}) == 2 or dynamic_filter is None
        for sample in group.samples:
            tokens = samples.decode_tokens(sample.tokens)
            assert tokens[: sample.prompt_length].tolist() == samples.decode_tokens(group.prompt_tokens).tolist()
            assert len(samples.decode_logprobs(sample.rollout_logprobs)) == sample.response_length
    system.buffer.CommitBatch(buffer_pb2.CommitBatchRequest(step=0), timeout=10)
    assert redis_client.exists(*batch.arrays_keys) == 0 and not redis_client.keys("*:upload:*")


def test_start_twice_and_commit_without_a_sync(system):
    _, gateway, _ = system
    assert gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10).started
    assert not gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10).started
    gateway.StopRollout(rollout_pb2.StopRolloutRequest(abort_in_flight=True), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        gateway.CommitWeightSync(rollout_pb2.CommitWeightSyncRequest(version=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "call PrepareWeightSync first" in info.value.details()


def test_killing_an_engine_mid_rollout_changes_only_the_time(system, start_engine):
    buffer, gateway, _ = system
    gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    wait_completed(buffer, 4)
    victim = next(iter(start_engine.procs.values()))
    victim.proc.send_signal(signal.SIGKILL)
    state = wait_completed(buffer, NUM_PROMPTS)
    gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    assert state.counters["completed"] == state.counters["started"] == NUM_PROMPTS
    assert state.counters.get("duplicate_submits", 0) == 0


def test_a_gateway_killed_mid_rollout_loses_nothing(grpc_service, channel_to, redis_url, tiny_model, start_engine,
                                                    service_process, tmp_path):  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i} and 2"}) + "\n" for i in range(NUM_PROMPTS)))
    buffer_service = grpc_service(build_buffer, BufferConfig(
        prompt_data=str(data), hf_checkpoint=str(tiny_model), num_data_workers=0, num_epoch=1, rollout_batch_size=4,
        n_samples_per_prompt=2, max_staleness=100, redis={"url": redis_url, "prefix": "kill"}, expire_interval_s=0.2,
    ))  # fmt: skip
    reward = grpc_service(build_reward, RewardConfig(rm_type="random", num_workers=1))
    engine = start_engine()
    buffer = buffer_pb2_grpc.BufferServiceStub(channel_to(buffer_service.address))
    args = ["rollout", "--port", "0", "--engine-urls", engine, "--buffer-addr", buffer_service.address,
            "--reward-addr", reward.address, "--lease-seconds", "2", "--rollout-max-response-len", "64",
            "--rollout-concurrency", "4", "--metrics-port", "null"]  # fmt: skip
    first = service_process(*args)
    started = start_rollout(first)
    assert started
    wait_completed(buffer, 2)
    first.proc.send_signal(signal.SIGKILL)  # its leased groups are in limbo until their leases expire
    first.proc.wait()
    second = service_process(*args)
    assert start_rollout(second)
    state = wait_completed(buffer, NUM_PROMPTS)
    assert state.counters["completed"] == state.counters["started"] == NUM_PROMPTS
    assert state.counters.get("duplicate_submits", 0) == 0
    assert state.counters["expired"] >= 1  # the killed gateway's groups came back through their leases
