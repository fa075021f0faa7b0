"""Partial rollout around a pause: `abort` returns in-flight groups to the buffer with what they generated and
resumes them later with the remaining token budget; `in_place` and `retract` keep them in the engine to continue
under the new weights (with their KV, or prefilled again). Either
way every sample's log-probs and weight-version spans cover its response exactly."""

import itertools
import time

import httpx
import pytest

from slipstream import samples
from slipstream.v1 import common_pb2, rollout_pb2
from tests.rollout.conftest import get_batch, wait_completed

MAX_LEN = 160
PROMPTS = 8  # all in flight at the pause (--rollout-concurrency 8): no later group adds anything but time


def _pause_mid_rollout(system, mode: str) -> None:
    """Starts the rollout, pauses the engines once requests are in flight, moves every engine to weight version
    v2 (what a weight sync ends with), and resumes."""
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    pool = system.rollout.pool
    deadline = time.monotonic() + 60
    while sum(e.outstanding for e in pool.engines.values()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # let the requests produce some tokens
    system.run(pool.pause(mode))
    for url in system.engines:
        httpx.post(f"{url}/update_weight_version", json={"new_version": "v2"}, timeout=30).raise_for_status()
    time.sleep(0.5)
    system.run(pool.resume())


def _all_samples(buffer) -> list[common_pb2.Sample]:
    found = []
    for step in range(PROMPTS // 4):
        batch = get_batch(buffer, step, 5)
        found += [s for g in batch.groups for s in g.samples]
    return found


def _check_aligned(sample: common_pb2.Sample, masked: int = 0) -> list[tuple[str, int, int]]:
    """`masked`: the response tokens that must have loss mask 0 (the first ones), the rest 1."""
    assert len(samples.decode_logprobs(sample.rollout_logprobs)) == sample.response_length
    assert samples.decode_mask(sample.loss_mask).tolist() == [0] * masked + [1] * (sample.response_length - masked)
    assert (
        samples.num_tokens(sample.tokens)
        == sample.prompt_length + sample.response_length
        <= sample.prompt_length + MAX_LEN
    )
    spans = [(s.version, s.start, s.end) for s in sample.weight_versions]
    assert spans[0][1] == 0 and spans[-1][2] == sample.response_length
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
    return spans


@pytest.mark.parametrize("mask_offpolicy", [False, True])
def test_abort_pause_returns_partial_groups_that_resume_where_they_stopped(make_system, mask_offpolicy):
    """With --mask-offpolicy-in-partial-rollout, the tokens a resumed sample had before the pause are not trained,
    nor any sample that a returned group had finished before it (all made by the old weights)."""
    system = make_system(partial_rollout=True, pause_mode="abort", rollout_max_response_len=MAX_LEN,
                         num_prompts=PROMPTS, mask_offpolicy_in_partial_rollout=mask_offpolicy)  # fmt: skip
    _pause_mid_rollout(system, "abort")
    state = wait_completed(system.buffer, PROMPTS, timeout_s=300)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    assert state.counters["released"] >= 1  # in-flight groups went back to the buffer
    assert state.counters["completed"] == state.counters["started"] == PROMPTS
    resumed = 0
    for sample in _all_samples(system.buffer):
        spans = [(s.version, s.start, s.end) for s in sample.weight_versions]
        old = sum(end - start for version, start, end in spans if version == "default")
        mask = samples.decode_mask(sample.loss_mask)
        masked = old if mask_offpolicy and (len(spans) > 1 or not mask.any()) else 0
        _check_aligned(sample, masked)
        assert sample.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
        if [v for v, _, _ in spans] == ["default", "v2"]:
            resumed += 1  # its first tokens from before the pause, the rest after: one response, one budget
    assert resumed >= 1


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_kept_requests_continue_under_the_new_version(make_system, mode):
    system = make_system(pause_mode=mode, rollout_max_response_len=MAX_LEN, num_prompts=PROMPTS)
    _pause_mid_rollout(system, mode)
    state = wait_completed(system.buffer, PROMPTS, timeout_s=300)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    assert state.counters.get("released", 0) == 0  # nothing was aborted
    spans = [_check_aligned(s) for s in _all_samples(system.buffer)]
    assert any([v for v, _, _ in s] == ["default", "v2"] for s in spans)  # kept (or re-prefilled), went on with v2
    assert all(all(v in ("default", "v2") for v, _, _ in s) for s in spans)
