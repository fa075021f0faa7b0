"""The slipstream services: buffer, rollout gateway, reward, trainer, and the plumbing they share (`common`)."""
