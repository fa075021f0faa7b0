"""Custom advantages (`--custom-advantage-function-path examples/slime_plugins/advantages.py:grpo_advantages`)
written as slime's are: `fn(args, rollout_data)` sets `rollout_data["advantages"]` and `["returns"]`, one tensor per
sample over its response tokens.

GRPO's: each sample's (already group-normalized) reward on every response token, minus `args.kl_coef` times the
per-token KL to the reference model.
"""

import torch


def grpo_advantages(args, rollout_data):
    advantages = []
    for reward, kl, length in zip(
        rollout_data["rewards"], rollout_data["kl"], rollout_data["response_lengths"], strict=True
    ):
        advantages.append(torch.full((length,), float(reward)) - args.kl_coef * kl)
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
