"""A reward post-processing (`--custom-reward-post-process-path examples/slime_plugins/rewards.py:rank_rewards`)
written as slime's are: `fn(args, samples) -> (raw_rewards, rewards)`, over the step's samples, each group's
`args.n_samples_per_prompt` of them one after another.

Each sample's reward becomes its rank within its group, centred and scaled to [-1, 1] (ties share their mean rank):
the trainer's estimator gets these instead of the group-normalized rewards.
"""


def rank_rewards(args, samples):
    raw = [float(sample.reward) for sample in samples]
    n = args.n_samples_per_prompt
    rewards = []
    for start in range(0, len(raw), n):
        group = raw[start : start + n]
        for value in group:
            below = sum(other < value for other in group)
            ties = sum(other == value for other in group)
            rank = below + (ties - 1) / 2
            rewards.append(2 * rank / (n - 1) - 1 if n > 1 else 0.0)
    return raw, rewards
