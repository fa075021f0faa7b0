"""Configuration of the rollout gateway. Names follow slime's arguments where slime has one."""

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.common import eval_sets
from services.common.config import HttpUrl, ServiceConfig
from services.common.eval_sets import EvalSets
from services.common.redis_connection import RedisConfig
from services.common.run_facts import RunConfig
from services.rollout.allowlist import LOOPBACK
from services.weightsync import factory


def needs_receivers(flag: str) -> str:
    return (
        f"{flag} sends the weights through a weight receiver beside each engine: start `slipstream receiver` beside "
        "each one and pass --weight-receiver-port-offset (docs/rollout.md)"
    )


class RolloutConfig(ServiceConfig):
    """The rollout gateway: engine pool, rollout workers, evaluation and the weight-sync control plane."""

    run: RunConfig = RunConfig()  # the run's facts, as every service has them (services/common/run_facts.py)

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    engine_urls: list[HttpUrl] = []
    """Engines to use from the start (http://host:port of SGLang servers or reference engines); more can register
    at run time (RegisterEngine)."""
    allowed_engine_hosts: list[str] = LOOPBACK
    """Hosts that RegisterEngine may add, as CIDRs (10.0.0.0/8) or host patterns (engine-*.svc.cluster.local): the
    weights go to every registered engine. --engine-urls and launched engines need no entry."""
    allowed_weight_sync_hosts: list[str] = LOOPBACK
    """Hosts that PrepareWeightSync may name as the weight group's master (the trainer's --weight-sync-address), as
    CIDRs or host patterns: the engines load whatever weights that address sends."""
    sglang_server_concurrency: int = Field(512, ge=1)
    """Most requests in flight to one engine at a time."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one /generate call; past it the request is retried on another engine."""
    max_retries: int = Field(3, ge=0)
    """How many other engines a failed /generate is retried on."""
    rollout_health_check_interval: float = Field(5.0, gt=0)
    """Seconds between health checks of every engine that answered no request meanwhile (slime's
    --rollout-health-check-interval)."""
    rollout_health_check_timeout: float = Field(20.0, gt=0)
    """A health check (/health_generate) slower than this counts as a failure."""
    rollout_health_check_failures: int = Field(2, ge=1)
    """Consecutive failures (health checks or requests) that evict an engine; it is re-admitted once healthy."""
    reward_addr: str = "localhost:50053"
    """The reward service (host:port) that scores samples."""
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
    opd_teacher_urls: list[HttpUrl] = []
    """Engines serving the teacher model (SGLang servers, or `slipstream engine`), SGLang's /generate."""
    opd_teacher_hf_checkpoint: str | None = None
    """Launch teacher engines serving this HF folder (as the policy's engines are, on the GPUs after theirs)."""
    opd_teacher_num_gpus: int = Field(1, ge=1)
    """GPUs of the launched teacher engines (--rollout-num-gpus-per-engine each)."""
    weight_receiver_port_offset: int | None = Field(None, ge=-65535, le=65535)
    """Each engine has a weight receiver beside it (`slipstream receiver`, same host) on the engine's port plus this:
    weight syncs stream through the receivers, one control call per sync, into SGLang's /update_weights_from_ipc
    (docs/rollout.md, "Weight sync"). Unset: each bucket is posted to the engines' /update_weights_from_distributed."""
    partial_rollout: bool = False
    """Samples aborted by a pause keep their tokens and continue later with max_new_tokens reduced (slime's
    --partial-rollout); off, they are generated again from the prompt."""
    mask_offpolicy_in_partial_rollout: bool = False
    """With --partial-rollout: the tokens a group's samples had before a pause (made by older weights) stay in the
    samples but are not trained (loss mask 0); only the tokens generated after it are."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How engines pause around a weight sync: abort in-flight requests (their groups go back to the buffer with what
    they generated), retract them to the engine's queue, or keep them in place to continue under the new weights."""
    custom_generate_function_path: str = ""
    """`pkg.mod:fn` or `file.py:fn`: an async fn(ctx, group) that returns a group's samples (multi-turn, tools)."""
    rollout_function_path: str = ""
    """slime's whole-rollout function, fn(args, rollout_id, data_source, evaluation=False) -> groups of samples: it
    leases groups with data_source.get_samples(n) and generates through args.sglang_router_ip/port (the engine pool).
    Replaces the built-in workers (docs/plugins.md)."""
    max_turns: int = Field(8, ge=1)
    """Most assistant turns of a multi-turn rollout (read by generate functions as ctx.config.max_turns)."""
    eval_temperature: float | None = Field(None, ge=0)
    """Sampling temperature of evaluation; unset takes --rollout-temperature."""
    eval_top_p: float | None = Field(None, gt=0, le=1)
    """Top-p of evaluation; unset takes --rollout-top-p."""
    eval_top_k: int | None = Field(None, ge=-1)
    """Top-k of evaluation; unset takes --rollout-top-k."""
    eval_max_response_len: int | None = Field(None, ge=1)
    """Most new tokens of an evaluation response; unset takes --rollout-max-response-len."""
    eval_min_new_tokens: int | None = Field(None, ge=0)
    """Fewest new tokens of an evaluation response (SGLang's min_new_tokens)."""
    eval_reward_key: str | None = None
    """Evaluation's reward is this number of a reward function's dict (e.g. `acc` of dapo's {score, acc}), as slime's
    --eval-reward-key; a reward that is a plain number stays as it is. Unset: the reward service's --reward-key."""
    rollout_num_gpus: int = Field(0, ge=0)
    """GPUs for engines the gateway launches itself (0: none, use --engine-urls). Without GPUs each slot is one
    reference engine on CPU."""
    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    """GPUs (tensor-parallel size) of each launched engine."""
    sglang_args: list[str] = []
    """Options for launched engines, given as --sglang-<option> value (e.g. --sglang-mem-fraction-static 0.8) and
    passed on as --<option> value."""
    engine_api_key_file: Path | None = None
    """File holding the engines' API key (SGLang's --api-key): sent as `Authorization: Bearer` on every engine call
    and given to the engines the gateway launches. (--sglang-api-key KEY works too, but shows the key in `ps`.)"""
    redis: RedisConfig = RedisConfig()
    """With --redis-url (the buffer's Redis), this gateway is one of the run's replicas (services/rollout/fleet.py):
    the engine registry is shared, each gateway generates on its share of the engines, and one of them (the
    coordinator) runs the weight syncs. Unset: this gateway owns every engine."""
    engine_discovery: list[str] = []
    """name:port of DNS names whose addresses are engines (a Kubernetes headless Service such as engine:30000),
    resolved again every --engine-discovery-interval-s; needs --redis-url."""
    engine_discovery_interval_s: float = Field(10.0, gt=0)
    """How often the coordinator resolves --engine-discovery names again."""
    fleet_heartbeat_s: float = Field(1.0, gt=0)
    """How often a gateway of a fleet (--redis-url) beats; it also follows the engine registry this often."""
    fleet_ttl_s: float = Field(5.0, gt=0)
    """A gateway whose beats stop this long is taken for dead: its engines (and the coordinator's lease) move."""
    advertise_addr: str | None = None
    """host:port where the other gateways reach this one (they forward weight-sync calls to the coordinator);
    default: --host and --port, with this machine's address for a wildcard host."""
    use_router: bool = False
    """Route generation through an sglang-router process (started by the gateway) instead of the built-in routing;
    control calls still go to each engine."""
    engine_log_dir: str = "outputs/engines"
    """Folder for the logs of launched engines and the router."""

    passthrough: ClassVar[dict[str, str]] = {"--sglang-": "sglang_args"}

    def eval_sets(self) -> EvalSets:
        """The sets of --eval-config (none without it: --eval-prompt-data's have no settings of their own)."""
        return eval_sets.read(self.eval_config)

    def _check_weight_sync(self) -> None:
        """The run's weight-sync rules (services/weightsync/factory.py), and the receivers that delta and streamed
        syncs go through: the engines it starts get theirs beside them (offset 1); others must have them."""
        if refused := factory.refusal(self.run):
            raise ValueError(refused)
        flag = {"delta": "--update-weight-mode delta"}.get(self.update_weight_mode)
        if self.update_weight_transport == "streamed":
            flag = "--update-weight-transport streamed"
        if flag and self.weight_receiver_port_offset is None:
            if not self.rollout_num_gpus:
                raise ValueError(needs_receivers(flag))
            self.weight_receiver_port_offset = 1

    @model_validator(mode="after")
    def _check_launch(self) -> "RolloutConfig":
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"rollout_num_gpus {self.rollout_num_gpus} is not a multiple of rollout_num_gpus_per_engine "
                f"{self.rollout_num_gpus_per_engine}"
            )
        if self.rollout_num_gpus and not self.hf_checkpoint:
            raise ValueError("rollout_num_gpus starts engines, which need the model: pass --hf-checkpoint")
        if self.engine_discovery and not self.redis.url:
            raise ValueError("engine_discovery fills the run's engine registry in Redis: give --redis-url too")
        for entry in self.engine_discovery:
            name, _, port = entry.rpartition(":")
            if not name or not port.isdigit():
                raise ValueError(f"engine_discovery {entry!r} is not name:port, e.g. engine:30000")
        if self.redis.url and not self.port and not self.advertise_addr:
            raise ValueError(
                "a gateway of a fleet (--redis-url) is reached by the others at its port: give --port "
                "(not 0) or --advertise-addr"
            )
        if self.rollout_function_path and self.custom_generate_function_path:
            raise ValueError(
                "--rollout-function-path replaces the workers that call --custom-generate-function-path: "
                "give one of them"
            )
        self.eval_sets()  # a bad file stops here, naming the set and the key
        self._check_weight_sync()
        if self.use_router and self.redis.url:
            raise ValueError("--use-router routes through one router per gateway; with --redis-url drop it")
        teachers = bool(self.opd_teacher_urls or self.opd_teacher_hf_checkpoint)
        if self.use_opd and self.opd_type == "sglang" and not teachers:
            raise ValueError(
                "--use-opd --opd-type sglang asks teacher engines for log-probs: add --opd-teacher-urls <url ...> or "
                "--opd-teacher-hf-checkpoint <HF folder>"
            )
        if teachers and not (self.use_opd and self.opd_type == "sglang"):
            raise ValueError("teacher engines serve --use-opd --opd-type sglang: add those, or drop the teacher")
        if self.engine_api_key_file is not None and not self.engine_api_key():
            raise ValueError(f"--engine-api-key-file {self.engine_api_key_file}: no such file, or it is empty")
        return self

    def engine_api_key(self) -> str | None:
        """The engines' API key: --engine-api-key-file's content, else --sglang-api-key's value."""
        if self.engine_api_key_file is not None:
            try:
                return self.engine_api_key_file.read_text().strip() or None
            except OSError:
                return None
        args = self.sglang_args
        return args[args.index("--api-key") + 1] if "--api-key" in args[:-1] else None
