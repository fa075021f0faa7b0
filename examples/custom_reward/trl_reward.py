"""A reward function as TRL's documentation writes it (GRPOTrainer's quick start), unchanged: slipstream's reward
service calls it the way TRL does (docs/reward.md, "Reward functions written for TRL")."""


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
