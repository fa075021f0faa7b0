"""Buffer groups as trainer tensors: lengths checked with sentences that name the group and the numbers, NaN rewards
refused, failed samples masked, and right-padded response and input tensors."""

import math

import pytest
import torch

from services.trainer.data import BatchError, check_reward_failures, from_groups, input_tensors, response_tensors
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
    """A reward function that raises, or a problem its checker cannot score, marks the sample failed: the share is the
    step's `reward_failed`, and over --max-reward-failures the run stops rather than train on the rest."""
    group = _group("g0", [[1], [2], [3], [4]], [0.0, 0.0, 0.0, 1.0])
    for sample in group.samples[:3]:
        sample.status = common_pb2.SAMPLE_STATUS_FAILED
        sample.status_message = f"item {sample.sample_id} (reasoning_gym): exception: ValueError: no source_dataset"
    batch = from_groups([group], 4)
    assert check_reward_failures(batch, 1.0) == 0.75
    stops = r"the reward failed for 3 of 4 samples of this step \(more than --max-reward-failures 0.5\), e.g. item g0/0"
    with pytest.raises(BatchError, match=stops):
        check_reward_failures(batch, 0.5)
    assert check_reward_failures(from_groups([_group("g1", [[1], [2]], [0.0, 1.0])], 2), 0.5) == 0.0
