"""Configuration of the buffer service."""

from pathlib import Path

from pydantic import Field

from services.common.config import ServiceConfig
from services.common.redis_connection import RedisConfig


class BufferConfig(ServiceConfig):
    """The data buffer: owns datasets and all sample state, in Redis."""

    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of the run: its Redis namespace and its folder under --output-dir."""
    output_dir: Path = Path("runs")
    """Folder of all runs; this run's files (and the embedded Redis data) go to <output-dir>/<run-id>."""
    redis: RedisConfig = RedisConfig()

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_id
