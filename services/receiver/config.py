"""Configuration of the weight receiver (`slipstream receiver`), the process beside each engine that takes the
trainer's streamed weights (docs/rollout.md, "Weight sync")."""

from typing import Literal

from pydantic import Field

from services.common.config import StrictModel


class ReceiverConfig(StrictModel):
    """Joins the trainer's weight group for its engine, receives each sync's buckets into a double buffer on the
    engine's GPUs and hands them to the engine through its /update_weights_from_ipc route."""

    engine_url: str
    """The engine it feeds, on the same host and GPUs (e.g. http://127.0.0.1:30000)."""
    host: str = "127.0.0.1"
    """Address its HTTP API listens on (the gateway calls it)."""
    port: int = Field(30100, ge=0, le=65535)
    """HTTP port."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the engine runs: its buffer lives there (CUDA memory the engine maps by IPC; shared memory on the CPU)."""
    base_gpu_id: int = Field(0, ge=0)
    """The engine's first GPU (its --base-gpu-id)."""
    tp_size: int = Field(1, ge=1)
    """The engine's GPUs (its --tp-size): each gets its own copy of every bucket."""
    gpu_id_step: int = Field(1, ge=1)
    """The step between the engine's GPUs (its --gpu-id-step)."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one sync's steps: a broadcast that has not arrived, or an engine that has not answered, by then
    ends the sync with an error, so the receiver never waits on a dead trainer or engine."""
    engine_api_key: str | None = None
    """The engine's --api-key, sent with its calls."""
    api_key: str | None = None
    """Every route but /health needs `Authorization: Bearer <api_key>` (as the engines' --api-key)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level that is printed."""
