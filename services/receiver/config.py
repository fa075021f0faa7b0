"""Configuration of the weight receiver (`slipstream receiver`), the process beside each engine that takes the
trainer's streamed weights (docs/rollout.md, "Weight sync")."""

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from services.common.config import StrictModel


class ReceiverConfig(StrictModel):
    """Joins the trainer's weight group for its engine, receives each sync's buckets into a few buckets' room on the
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
    buffer_mib: int = Field(2048, ge=0)
    """GPU memory for buckets on each of the engine's GPUs, in MiB: as many of the trainer's buckets
    (--update-weight-buffer-size) as fit, at least 3 whatever it is and no more than a sync has. The engine loads the
    buckets received so far while the next ones arrive: more room lets the transfer go on while the engine loads,
    and hands the engine more buckets a call."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one sync's steps: a broadcast that has not arrived, or an engine that has not answered, by then
    ends the sync with an error, so the receiver never waits on a dead trainer or engine."""
    engine_api_key: str | None = None
    """The engine's --api-key, sent with its calls."""
    engine_api_key_file: Path | None = None
    """File holding the engine's --api-key (a Secret's file, so that the key is on no command line)."""
    api_key: str | None = None
    """Every route but /health needs `Authorization: Bearer <api_key>` (as the engines' --api-key)."""
    api_key_file: Path | None = None
    """File holding --api-key. The gateway sends the engines' key to their receivers too: give both the same file."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level that is printed."""

    @field_validator("engine_url")
    @classmethod
    def _engine_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL of a host; give the engine's, e.g. "
                             "http://127.0.0.1:30000")  # fmt: skip
        parts.port  # noqa: B018 - raises on a bad port
        return url

    @model_validator(mode="after")
    def _read_key_files(self) -> "ReceiverConfig":
        for name in ("engine_api_key", "api_key"):
            path = getattr(self, f"{name}_file")
            if path is None:
                continue
            flag = f"--{name.replace('_', '-')}"
            if getattr(self, name) is not None:
                raise ValueError(f"{flag} and {flag}-file both give the key: pass one")
            try:
                key = path.read_text().strip()
            except OSError as e:
                raise ValueError(f"{flag}-file {path}: {e.strerror}; fix the path or the file's permissions") from None
            if not key:
                raise ValueError(f"{flag}-file {path} is empty; write the key in it")
            setattr(self, name, key)
        return self
