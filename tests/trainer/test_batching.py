"""Steps and micro-batches: slime's batch constraint with messages that name the numbers, fixed and dynamic
(token-budget) micro-batches, and padding that stays small."""

import random

import pytest

from services.trainer.batching import BatchSizeError, BatchSizes, micro_batches, padding_ratio, split_steps


def test_slimes_constraint_names_the_numbers():
    BatchSizes(32, 8, 128, 2, dp_size=4, micro_batch_size=2).check()
    with pytest.raises(BatchSizeError) as info:
        BatchSizes(32, 8, 100, 2, dp_size=1, micro_batch_size=1).check()
    assert "32 * 8 = 256 samples per rollout" in str(info.value) and "100 * 2 = 200" in str(info.value)
    assert "--global-batch-size 128" in str(info.value)
    with pytest.raises(BatchSizeError, match="global_batch_size 256 is not divisible by the data-parallel size 3"):
        BatchSizes(32, 8, 256, 1, dp_size=3, micro_batch_size=1).check()
    with pytest.raises(BatchSizeError, match="not divisible by micro_batch_size 3"):
        BatchSizes(32, 8, 256, 1, dp_size=2, micro_batch_size=3).check()


def test_steps_split_a_rollout_in_order():
    assert split_steps(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(BatchSizeError):
        split_steps(list(range(5)), 2)


def test_fixed_micro_batches_group_similar_lengths():
    assert micro_batches([5, 100, 7, 90], micro_batch_size=2, max_tokens=None) == [[1, 3], [2, 0]]


def test_dynamic_micro_batches_respect_the_token_budget_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.randint(50, 2000) for _ in range(256)]
    batches = micro_batches(lengths, None, max_tokens=8192)
    assert sorted(i for b in batches for i in b) == list(range(256))  # every sample exactly once
    assert all(len(b) * max(lengths[i] for i in b) <= 8192 for b in batches)
    assert padding_ratio(lengths, batches) < 0.05
    with pytest.raises(BatchSizeError, match="a sample of 9000 tokens does not fit --max-tokens-per-gpu 8192"):
        micro_batches([10, 9000], None, max_tokens=8192)
