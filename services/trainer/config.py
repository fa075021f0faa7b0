"""Configuration of the trainer service."""

from pydantic import Field

from services.common.config import ServiceConfig


class TrainerConfig(ServiceConfig):
    """The trainer's control surface: status, checkpoints, stop."""

    port: int = Field(50054, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
