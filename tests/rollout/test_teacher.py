"""On-policy distillation's teacher engines (--use-opd --opd-type sglang): the gateway stores the teacher's log-prob
of every response token with each training sample, from a pool of teacher engines of its own; a teacher that dies is
evicted and the others answer; with none, no group completes without them."""

import time

import httpx
import pytest

from services.common.processes import free_port
from slipstream import samples
from slipstream.v1 import rollout_pb2
from tests.rollout.conftest import get_batch, wait_completed, wait_healthy


def _teacher_logprobs(url: str, tokens: list[int]) -> list[float]:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}  # fmt: skip
    entries = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]["input_token_logprobs"]
    return [e[0] for e in entries[1:]]


def test_each_training_sample_carries_its_teachers_logprobs_and_a_dead_teacher_is_evicted(
    make_system, start_engine, caplog
):
    teachers = start_engine.many([(), ()], [None, None])
    system = make_system(num_engines=1, use_opd=True, opd_type="sglang", opd_teacher_urls=teachers)
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    wait_completed(system.buffer, 4)
    start_engine.procs[teachers[0]].proc.kill()  # the other teacher answers from now on
    wait_completed(system.buffer, 8)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(abort_in_flight=True), timeout=60)
    for step in (0, 1):
        for group in get_batch(system.buffer, step, 30).groups:
            for sample in group.samples:
                got = samples.decode_logprobs(sample.teacher_logprobs)
                assert len(got) == sample.response_length > 0
                # the teacher serves the policy's own model: its log-probs of the sampled tokens are the engine's
                expected = _teacher_logprobs(teachers[1], samples.decode_tokens(sample.tokens).tolist())
                assert got.tolist() == pytest.approx(expected[-sample.response_length :], abs=1e-4)
                rollout = samples.decode_logprobs(sample.rollout_logprobs)
                assert got.tolist() == pytest.approx(rollout.tolist(), abs=1e-3)
    deadline = time.monotonic() + 60  # no request may have gone to it since: then its health check finds it
    while f"engine {teachers[0]}" not in caplog.text:  # its failure, logged as the pool logs a policy engine's
        assert time.monotonic() < deadline, "the killed teacher's failure was never logged"
        time.sleep(0.1)


def test_with_no_teacher_answering_no_group_completes(make_system, start_engine):
    port = free_port()  # nothing listens there
    system = make_system(num_engines=1, use_opd=True, opd_type="sglang", opd_teacher_urls=[f"http://127.0.0.1:{port}"])
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    with pytest.raises(BaseException, match="groups completed"):
        wait_completed(system.buffer, 1, timeout_s=8)
    teacher = start_engine(port=port)  # admitted by the health checks once it answers: groups complete
    wait_healthy(start_engine.procs[teacher], teacher)
    wait_completed(system.buffer, 4)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(abort_in_flight=True), timeout=60)
    for group in get_batch(system.buffer, 0, 30).groups:
        assert all(len(samples.decode_logprobs(s.teacher_logprobs)) == s.response_length for s in group.samples)
