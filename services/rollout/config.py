"""Configuration of the rollout gateway. Names follow slime's arguments where slime has one."""

from pydantic import Field

from services.common.config import ServiceConfig


class RolloutConfig(ServiceConfig):
    """The rollout gateway: engine pool, rollout workers, evaluation and the weight-sync control plane."""

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    engine_urls: list[str] = []
    """Engines to use from the start (http://host:port of SGLang servers or reference engines); more can register
    at run time (RegisterEngine)."""
    sglang_server_concurrency: int = Field(512, ge=1)
    """Most requests in flight to one engine at a time."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one /generate call; past it the request is retried on another engine."""
    max_retries: int = Field(3, ge=0)
    """How many other engines a failed /generate is retried on."""
    rollout_health_check_interval: float = Field(5.0, gt=0)
    """Seconds between health checks of every engine (slime's --rollout-health-check-interval)."""
    rollout_health_check_timeout: float = Field(20.0, gt=0)
    """A health check (/health_generate) slower than this counts as a failure."""
    rollout_health_check_failures: int = Field(2, ge=1)
    """Consecutive failures (health checks or requests) that evict an engine; it is re-admitted once healthy."""
    buffer_addr: str = "localhost:50051"
    """The buffer service (host:port) that leases prompt groups and takes finished ones."""
    reward_addr: str = "localhost:50053"
    """The reward service (host:port) that scores samples."""
    rm_type: str = ""
    """Reward type asked of the reward service; empty uses the reward service's own default."""
    rollout_concurrency: int = Field(64, ge=1)
    """Prompt groups generated at once."""
    lease_seconds: float = Field(120.0, gt=0)
    """Lease asked for each group; it is extended while the group is worked on, so only a dead gateway lets it lapse."""
    rollout_temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Top-p of rollouts."""
    rollout_top_k: int = Field(-1, ge=-1)
    """Top-k of rollouts (-1: off)."""
    rollout_max_response_len: int = Field(1024, ge=1)
    """Most new tokens of one response."""
    rollout_stop: list[str] = []
    """Stop strings of rollouts."""
    rollout_stop_token_ids: list[int] = []
    """Stop token ids of rollouts."""
    affinity_slack: int = Field(4, ge=0)
    """Samples of one prompt group go to the same engine (its prefix cache) unless it has this many more requests
    in flight than the least busy engine."""
