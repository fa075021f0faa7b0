"""The buffer as a real gRPC service: status codes for bad requests, and `kill -9` of the process (with its
embedded Redis) between a lease and its submit and between GetBatch and CommitBatch."""

import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import build
from slipstream.samples import decode_logprobs, encode_tokens, put_batch_arrays, take_arrays
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from tests.buffer.conftest import finish, write_jsonl
from tests.redis_servers import settings as redis_settings


@pytest.fixture
def stub(grpc_service, redis_url, tokenizer_dir, prompts_file, channel_to):
    config = BufferConfig(
        prompt_data=str(prompts_file),
        hf_checkpoint=str(tokenizer_dir),
        label_key="label",
        num_data_workers=0,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        redis=redis_settings(redis_url, prefix="svc"),
    )
    return buffer_pb2_grpc.BufferServiceStub(channel_to(grpc_service(build, config).address))


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


def test_bad_requests_are_invalid_argument_or_not_found(stub):
    code, details = code_of(stub.LeasePrompts, buffer_pb2.LeasePromptsRequest(max_groups=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_groups:")
    code, details = code_of(stub.LeasePrompts, buffer_pb2.LeasePromptsRequest(max_groups=1, dataset="gsm8k"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown dataset 'gsm8k'" in details
    group = finish(common_pb2.PromptGroup(group_id="train:e0:b0:r1", prompt_tokens=encode_tokens([1, 2])), [0.0, 1.0])
    code, details = code_of(stub.SubmitGroup, buffer_pb2.SubmitGroupRequest(lease_id="train:e0:b0:r1#4", group=group))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown to this run" in details
    code, details = code_of(stub.ReleaseLease, buffer_pb2.ReleaseLeaseRequest(lease_id="train:e0:b0:r1#4"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = code_of(stub.GetBatch, buffer_pb2.GetBatchRequest(step=0, timeout_seconds=0.1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "only 0 of 2 groups" in details
    code, details = code_of(stub.CommitBatch, buffer_pb2.CommitBatchRequest(step=0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no batch was handed out for step 0" in details


def test_round_trip_over_grpc(stub, redis_client):
    """One group sent whole, one with its arrays uploaded to Redis first (as a gateway with --redis-url does); the
    trainer gets them back with the arrays in the reply, or reads them from Redis itself; a commit deletes them."""
    leases = stub.LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=2), timeout=10).leases
    assert len(leases) == 2 and leases[0].deadline.seconds > 0
    assert leases[1].upload_key.startswith("svc:{default}:upload:") and leases[1].submit_namespace == "svc:{default}"
    sent = [finish(lease.group, [0, 1]) for lease in leases]
    assert stub.SubmitGroup(buffer_pb2.SubmitGroupRequest(lease_id=leases[0].lease_id, group=sent[0])).accepted
    request = buffer_pb2.SubmitGroupRequest(lease_id=leases[1].lease_id, group=sent[1], arrays_in_redis=True)
    code, details = code_of(stub.SubmitGroup, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "arrays are uploaded" in details
    arrays = take_arrays(without_arrays := _copy(sent[1]))
    request.group.CopyFrom(without_arrays)
    code, details = code_of(stub.SubmitGroup, request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no arrays were uploaded" in details
    redis_client.set(leases[1].upload_key, arrays)
    assert stub.SubmitGroup(request).accepted
    redis_client.set(leases[1].upload_key, arrays)  # a retry's upload: dropped with it
    assert stub.SubmitGroup(request).duplicate
    assert not redis_client.keys("svc:*upload*")

    ask = buffer_pb2.GetBatchRequest(step=0, dp_rank=0, dp_size=1, timeout_seconds=5)
    batch = stub.GetBatch(ask, timeout=10)
    assert not any(s.tokens for g in batch.groups for s in g.samples) and not batch.arrays_keys
    put_batch_arrays(batch.groups, batch.arrays)
    ask.arrays_from_redis = True
    keyed = stub.GetBatch(ask, timeout=10)
    assert not keyed.arrays and len(keyed.arrays_keys) == 2
    put_batch_arrays(keyed.groups, redis_client.mget(keyed.arrays_keys))
    for got in (batch, keyed):
        by_id = {g.group_id: g for g in got.groups}
        for lease, group in zip(leases, sent, strict=True):
            assert [s.tokens for s in by_id[lease.group.group_id].samples] == [s.tokens for s in group.samples]
    assert decode_logprobs(batch.groups[0].samples[0].rollout_logprobs).tolist() == [-0.5] * 3
    assert stub.CommitBatch(buffer_pb2.CommitBatchRequest(step=0)).num_deleted_groups == 2
    state = stub.GetState(buffer_pb2.GetStateRequest())
    assert state.last_committed_step == 0 and state.counters["trained"] == 2
    assert redis_client.exists(*keyed.arrays_keys) == 0


def _copy(group: common_pb2.PromptGroup) -> common_pb2.PromptGroup:
    copy = common_pb2.PromptGroup()
    copy.CopyFrom(group)
    return copy


def test_state_is_exported_as_prometheus_gauges(grpc_service, redis_url, tokenizer_dir, prompts_file):
    config = BufferConfig(
        prompt_data=str(prompts_file), hf_checkpoint=str(tokenizer_dir), num_data_workers=0, rollout_batch_size=3,
        redis=redis_settings(redis_url, prefix="metrics"), expire_interval_s=0.1,
    )  # fmt: skip
    running = grpc_service(build, config)
    with grpc.insecure_channel(running.address) as channel:
        buffer_pb2_grpc.BufferServiceStub(channel).LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=3))
    deadline = time.monotonic() + 10
    line = 'slipstream_buffer_count{name="num_leased_groups"} 3.0'
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics_port}/metrics") as response:
            if line in response.read().decode():
                return
        time.sleep(0.1)
    pytest.fail(f"{line} never appeared on /metrics")


def start_buffer(service_process, wait_serving, port, run_dir, data, tokenizer):
    proc = service_process(
        "buffer", "--host", "127.0.0.1", "--port", str(port), "--output-dir", str(run_dir), "--prompt-data", str(data),
        "--hf-checkpoint", str(tokenizer), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--max-staleness", "10", "--num-data-workers", "1", "--rollout-shuffle",
    )  # fmt: skip
    wait_serving(f"127.0.0.1:{port}", proc)
    return proc


def child_pids(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def assert_exited(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"child processes {alive} outlived the killed buffer")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_kill_9_loses_and_duplicates_nothing(service_process, wait_serving, free_port, tmp_path, tokenizer_dir):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i} + 1?"} for i in range(12)])
    port, runs = free_port(), tmp_path / "runs"
    start = lambda: start_buffer(service_process, wait_serving, port, runs, data, tokenizer_dir)  # noqa: E731
    proc = start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        leases = list(stub.LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=3), timeout=30).leases)
    children = child_pids(proc.proc.pid)
    assert len(children) >= 2, "the embedded Redis, a data worker (and multiprocessing's resource tracker)"
    os.kill(proc.proc.pid, signal.SIGKILL)  # between the lease and its submit
    proc.wait()
    assert_exited(children)  # a second Redis on the same AOF would corrupt it

    proc = start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        for lease in leases:  # the workers did not notice: their submits still count, once
            request = buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=finish(lease.group, [0, 1]))
            assert stub.SubmitGroup(request, timeout=10).accepted
        more = stub.LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=3), timeout=30).leases
        seen = [lease.group.group_id for lease in [*leases, *more]]
        assert len(set(seen)) == 6, "a restarted buffer handed out a prompt twice"
        for lease in more:
            stub.SubmitGroup(buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=finish(lease.group, [0, 1])))
        request = buffer_pb2.GetBatchRequest(step=0, dp_size=1, timeout_seconds=10)
        first = [g.group_id for g in stub.GetBatch(request, timeout=30).groups]
    os.kill(proc.proc.pid, signal.SIGKILL)  # between GetBatch and CommitBatch
    proc.wait()

    proc = start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        again = stub.GetBatch(request, timeout=30)
        assert [g.group_id for g in again.groups] == first, "the interrupted step must get the same batch"
        assert all(len(g.samples) == 2 for g in again.groups)
        assert stub.CommitBatch(buffer_pb2.CommitBatchRequest(step=0), timeout=10).num_deleted_groups == 2
        state = stub.GetState(buffer_pb2.GetStateRequest(), timeout=10)
        assert state.num_completed_groups == 4 and state.counters["trained"] == 2
        assert state.counters["started"] == 6 and state.counters["completed"] == 6
    assert proc.terminate() == 0


def test_a_bad_dataset_row_stops_the_service_with_its_line(service_process, free_port, tmp_path, tokenizer_dir):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "ok"}\n{"question": "x"}\n')
    proc = service_process("buffer", "--port", str(free_port()), "--output-dir", str(tmp_path / "runs"),
                           "--prompt-data", str(data), "--hf-checkpoint", str(tokenizer_dir))  # fmt: skip
    assert proc.wait() == 1
    assert 'p.jsonl line 2: field "prompt" missing (keys present: question); pass --input-key <key>' in proc.log
    assert "Traceback" not in proc.log


def test_prompts_need_a_tokenizer(service_process, tmp_path):
    proc = service_process("buffer", "--port", "0", "--prompt-data", "x.jsonl")
    assert proc.wait() == 2
    assert "hf_checkpoint is required to tokenize prompts; pass --hf-checkpoint" in proc.log
