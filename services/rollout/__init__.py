"""The rollout gateway: engine pool, rollout workers, evaluation, and the weight-sync control plane."""
