"""Configuration of the rollout service."""

from pydantic import Field

from services.common.config import ServiceConfig


class RolloutConfig(ServiceConfig):
    """The rollout gateway: engine pool, rollout workers, evaluation and the weight-sync control plane."""

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
