"""Configuration of the reward service."""

from pydantic import Field

from services.common.config import ServiceConfig


class RewardConfig(ServiceConfig):
    """The reward service: built-in verifiers, custom reward functions and remote reward models."""

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
