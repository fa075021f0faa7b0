"""The gateway's promise at length, every part a real process (buffer with embedded Redis, reward service, two
reference engines, gateway): a rollout of several hundred groups in which one engine is SIGKILLed and then the
gateway itself is SIGKILLed and restarted, and still every group reaches the buffer exactly once."""

import json
import signal

import pytest

from slipstream import samples
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from tests.rollout.conftest import gateway_address, get_batch, start_rollout, wait_completed

NUM_GROUPS = 300
BATCH = 20


@pytest.mark.slow  # `make test` kills a gateway mid-rollout in tests/rollout/test_workers.py, an engine in tests/faults
def test_hundreds_of_groups_survive_an_engine_kill_and_a_gateway_restart(
    service_process, wait_serving, free_port, channel_to, start_engine, tiny_model, tmp_path
):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Add {i} and {i}", "label": str(2 * i)}) + "\n" for i in range(NUM_GROUPS))
    )
    buffer_port, reward_port = free_port(), free_port()
    buffer_proc = service_process(
        "buffer", "--port", str(buffer_port), "--prompt-data", str(data), "--label-key", "label",
        "--hf-checkpoint", str(tiny_model), "--num-data-workers", "0", "--num-epoch", "1",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "2", "--max-staleness", "1000",
        "--expire-interval-s", "0.2", "--output-dir", str(tmp_path / "out"), "--metrics-port", "null",
    )  # fmt: skip
    reward_proc = service_process("reward", "--port", str(reward_port), "--rm-type", "math", "--metrics-port", "null")
    wait_serving(f"127.0.0.1:{buffer_port}", buffer_proc, timeout_s=60)
    wait_serving(f"127.0.0.1:{reward_port}", reward_proc, timeout_s=60)
    engines = start_engine.many([(), ()], [None, None])
    args = ["rollout", "--port", "0", "--engine-urls", *engines, "--buffer-addr", f"127.0.0.1:{buffer_port}",
            "--reward-addr", f"127.0.0.1:{reward_port}", "--lease-seconds", "3", "--rollout-max-response-len", "8",
            "--rollout-concurrency", "16", "--rollout-health-check-interval", "0.5",
            "--metrics-port", "null"]  # fmt: skip
    buffer = buffer_pb2_grpc.BufferServiceStub(channel_to(f"127.0.0.1:{buffer_port}"))

    gateway = service_process(*args)
    assert start_rollout(gateway)
    wait_completed(buffer, NUM_GROUPS // 5)
    start_engine.procs[engines[0]].proc.send_signal(signal.SIGKILL)
    wait_completed(buffer, NUM_GROUPS // 2)
    gateway.proc.send_signal(signal.SIGKILL)  # its leased groups come back when their leases expire
    gateway.proc.wait()
    restarted = service_process(*args)
    gateway_address(restarted)
    assert start_rollout(restarted)
    state = wait_completed(buffer, NUM_GROUPS, timeout_s=300)

    assert state.counters["completed"] == state.counters["started"] == NUM_GROUPS
    assert state.counters.get("duplicate_submits", 0) == 0 and state.num_leased_groups == 0
    assert state.counters["expired"] >= 1
    seen = []
    for step in range(NUM_GROUPS // BATCH):
        batch = get_batch(buffer, step, 10)
        for group in batch.groups:
            seen.append(group.group_id)
            assert len(group.samples) == 2
            for sample in group.samples:
                assert sample.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
                assert len(samples.decode_logprobs(sample.rollout_logprobs)) == sample.response_length
        buffer.CommitBatch(buffer_pb2.CommitBatchRequest(step=step), timeout=10)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == NUM_GROUPS
