"""Configuration of the reward service. Names follow slime's arguments (`--rm-type`, `--custom-rm-path`, …)."""

import os

from pydantic import Field, model_validator

from services.common import eval_sets
from services.common.config import HostPort, HttpUrl, ServiceConfig
from services.common.run_facts import RunConfig


class RewardConfig(ServiceConfig):
    """The reward service: built-in verifiers, custom reward functions and remote reward models."""

    run: RunConfig = RunConfig()  # the run's facts, as every service has them (services/common/run_facts.py)

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    custom_rm_path: str | None = None
    """Your reward function (pkg.mod:fn or file.py:fn), fn(args, sample) -> number or dict, sync or async; with
    --group-rm, fn(args, samples) -> list. It replaces the built-in types."""
    custom_rm_args: dict = {}
    """Settings for your reward function, as JSON (it reads them as args.custom_rm_args)."""
    reward_key: str = "score"
    """When a reward function returns a dict, the key of the trained reward; the other numbers become details."""
    reward_on_error: float = 0.0
    """Reward of an item whose verifier failed, timed out or crashed (the result also says error)."""
    rm_timeout_s: float = Field(10.0, gt=0)
    """Per-item deadline of a verifier or reward function (math parsers can hang on adversarial input)."""
    num_workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, le=256)
    """Worker processes that run verifiers and reward functions (isolated: a crash or hang costs one item)."""
    reward_worker_memory_mb: int | None = Field(8192, ge=128)
    """Memory a worker may allocate (its data segment and anonymous mappings, RLIMIT_DATA), in MiB. A verifier or
    reward function that needs more fails its item, and its worker is replaced. null: no limit."""
    rm_url: HttpUrl | None = None
    """Remote reward model over HTTP (slime's remote_rm): POST {prompt, response, label} → a number or a dict."""
    rm_grpc_addr: HostPort | None = None
    """Remote reward service over gRPC (host:port of any server implementing slipstream.v1.RewardService)."""
    rm_max_retries: int = Field(5, ge=0)
    """Retries of a remote reward call after a failure, with exponential backoff."""
    rm_retry_backoff_s: float = Field(0.5, ge=0)
    """First retry delay of a remote reward call; it doubles each retry (capped at 30 s)."""
    rm_remote_timeout_s: float = Field(60.0, gt=0)
    """Deadline of one remote reward call."""

    def eval_rm_types(self) -> dict[str, str]:
        """The reward type of each --eval-config set that names one, by set name."""
        return eval_sets.read(self.eval_config).rm_types()

    @model_validator(mode="after")
    def _read_eval_config(self) -> "RewardConfig":
        self.eval_rm_types()  # a bad file stops here, naming the set and the key
        return self
