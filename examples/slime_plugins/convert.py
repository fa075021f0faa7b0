"""A conversion of samples to training data (`--custom-convert-samples-to-train-data-path
examples/slime_plugins/convert.py:convert_samples_to_train_data`) written as slime's are: `fn(args, samples) -> dict`
with tokens, response_lengths, rewards (normalized), raw_reward, truncated, sample_indices and loss_masks.

It builds what slime's own conversion builds, with GRPO's group normalization of the rewards, and trains nothing of a
sample whose generation or reward failed (its loss mask is all zeros; it still counts in its group's statistics).
"""

import statistics


def convert_samples_to_train_data(args, samples):
    raw = [float(sample.reward) for sample in samples]
    n = args.n_samples_per_prompt
    rewards = []
    for start in range(0, len(raw), n):
        group = raw[start : start + n]
        mean, std = statistics.fmean(group), statistics.stdev(group) if n > 1 else 0.0
        rewards += [(value - mean) / (std + 1e-6) for value in group]
    failed = [sample.status in (sample.Status.FAILED, sample.Status.ABORTED) for sample in samples]
    return {
        "tokens": [sample.tokens for sample in samples],
        "response_lengths": [sample.response_length for sample in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "truncated": [int(sample.status == sample.Status.TRUNCATED) for sample in samples],
        "sample_indices": [sample.index for sample in samples],
        "loss_masks": [
            [0] * s.response_length if bad else list(s.loss_mask or [1] * s.response_length)
            for s, bad in zip(samples, failed, strict=True)
        ],
        "rollout_log_probs": [sample.rollout_log_probs for sample in samples],
    }
