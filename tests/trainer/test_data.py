"""Buffer groups as trainer tensors: lengths checked with sentences that name the group and the numbers, NaN rewards
refused, failed samples masked, and right-padded response and input tensors."""

import math

import pytest
import torch

from services.common.errors import RunStopped
from services.trainer import reward_failures
from services.trainer.data import BatchError, from_groups, input_tensors, response_tensors
from slipstream import samples
from slipstream.v1 import common_pb2


def _group(gid: str, responses: list[list[int]], rewards: list[float], prompt=(7, 8)) -> common_pb2.PromptGroup:
    group = common_pb2.PromptGroup(group_id=gid, n_samples=len(responses))
    for i, (response, reward) in enumerate(zip(responses, rewards, strict=True)):
        group.samples.add(
            sample_id=f"{gid}/{i}", index=i, tokens=samples.encode_tokens([*prompt, *response]),
            prompt_length=len(prompt), response_length=len(response), reward=reward,
            loss_mask=samples.encode_mask([1] * len(response)),
            rollout_logprobs=samples.encode_logprobs([-0.5] * len(response)),
        )  # fmt: skip
    return group


def test_groups_become_padded_tensors():
    batch = from_groups([_group("g0", [[1, 2, 3], [4]], [1.0, 0.0]), _group("g1", [[5, 6], [9, 9]], [0.5, 0.5])], 2)
    assert len(batch) == 4 and batch.rewards_B.tolist() == [1.0, 0.0, 0.5, 0.5]
    responses = response_tensors(batch)
    assert responses["loss_mask_BR"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert responses["rollout_logprobs_BR"][1].tolist() == [-0.5, 0, 0]
    inputs = input_tensors(batch, [0, 1])
    assert inputs["tokens_BL"].tolist() == [[7, 8, 1, 2, 3], [7, 8, 4, 0, 0]]
    assert inputs["prompt_lengths_B"].tolist() == [2, 2] and inputs["lengths_B"].tolist() == [5, 3]


def test_inconsistent_or_nan_samples_are_refused_with_the_numbers():
    bad = _group("g0", [[1, 2]], [1.0])
    bad.samples[0].response_length = 3
    with pytest.raises(BatchError, match=r"group g0 sample 0: 4 tokens, but prompt_length \+ response_length = 2 \+ 3"):
        from_groups([bad], 1)
    with pytest.raises(BatchError, match="group g1 sample 0: reward is nan"):
        from_groups([_group("g1", [[1]], [math.nan])], 1)
    with pytest.raises(BatchError, match="group g2 has 1 samples, expected 2"):
        from_groups([_group("g2", [[1]], [1.0])], 2)


def test_failed_samples_are_not_trained_on():
    group = _group("g0", [[1, 2], [3, 4]], [0.0, 1.0])
    group.samples[0].status = common_pb2.SAMPLE_STATUS_FAILED
    mask = response_tensors(from_groups([group], 2))["loss_mask_BR"]
    assert torch.equal(mask, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_a_step_whose_rewards_mostly_failed_stops_with_the_reason():
    """A reward function that raises, or a problem its checker cannot score, marks the sample failed with the reward
    type and the kind: the step's metrics count them, and over --max-reward-failures the run stops rather than train
    on the rest."""
    group = _group("g0", [[1], [2], [3], [4]], [0.0, 0.0, 0.0, 1.0])
    for sample, kind in zip(group.samples[:3], ["exception", "exception", "timeout"], strict=False):
        sample.status = common_pb2.SAMPLE_STATUS_FAILED
        message = f"item {sample.sample_id} (custom r.py:f): {kind}: ValueError: no answer"
        sample.reward_error.CopyFrom(common_pb2.RewardError(rm_type="custom", kind=kind, message=message))
    batch = from_groups([group], 4)
    failures = reward_failures.gather(0, len(batch), batch.reward_failures)
    assert failures.metrics() == {
        "reward_failed": 0.75,
        "reward_errors/custom/exception": 2.0,
        "reward_errors/custom/timeout": 1.0,
    }
    assert failures.firsts()["custom/exception"]["message"].startswith("item g0/0 (custom r.py:f)")
    assert not failures.over(1.0) and failures.over(0.5)
    stop = failures.stop(7, 0.5, "fix it")
    assert isinstance(stop, RunStopped) and str(stop) == (
        "step 7: the reward failed for 3 of 4 samples (more than --max-reward-failures 0.5), e.g. item g0/0 "
        "(custom r.py:f): exception: ValueError: no answer; fix it"
    )
    clean = from_groups([_group("g1", [[1], [2]], [0.0, 1.0])], 2)
    assert reward_failures.gather(0, len(clean), clean.reward_failures).metrics() == {"reward_failed": 0.0}
