"""Configuration of the buffer service. Field names follow slime's arguments (`--prompt-data`, `--input-key`, …)."""

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from services.common import eval_sets
from services.common.config import ServiceConfig
from services.common.eval_sets import EvalSets
from services.common.redis_connection import RedisConfig
from services.common.run_facts import RunConfig

log = logging.getLogger(__name__)


class BufferConfig(ServiceConfig):
    """The data buffer: owns datasets and all sample state, in Redis."""

    run: RunConfig = RunConfig()  # the run's facts, as every service has them (services/common/run_facts.py)

    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    output_dir: Path = Path("runs")
    """Folder of all runs; this run's files (and the embedded Redis data) go to <output-dir>/<run-id>."""
    redis: RedisConfig = RedisConfig()

    # Datasets
    prompt_data: str | None = None
    """Training prompts: a .jsonl or .parquet file, optionally sliced by rows as path@[a:b]."""
    eval_prompt_data: list[str] = []
    """Evaluation sets as name/path pairs: aime a.jsonl gsm8k g.parquet@[0:500]."""
    eval_input_key: str | None = None
    """Row field of the eval sets' prompts; unset takes --input-key."""
    eval_label_key: str | None = None
    """Row field of the eval sets' labels; unset takes --label-key."""
    eval_tool_key: str | None = None
    """Row field of the eval sets' tool specs; unset takes --tool-key."""
    eval_max_prompt_len: int | None = Field(None, ge=1)
    """Eval prompts with more tokens are skipped; unset: no bound (as in slime; not --rollout-max-prompt-len)."""
    input_key: str = "prompt"
    """Row field holding the prompt: a string, or a list of chat messages."""
    label_key: str | None = None
    """Row field holding the label (reference answer) passed to the reward."""
    metadata_key: str = "metadata"
    """Row field holding per-prompt metadata (an object, or a JSON string); carried to rollout and reward."""
    tool_key: str | None = None
    """Row field holding tool specs for the chat template (a list, or a JSON string)."""
    apply_chat_template: bool = False
    """Render prompts through the tokenizer's chat template with add_generation_prompt."""
    apply_chat_template_kwargs: dict = {}
    """Extra template variables as JSON, e.g. '{"enable_thinking": false}'."""
    rollout_max_prompt_len: int | None = Field(None, ge=1)
    """Prompts with more tokens are skipped (and counted as skipped:prompt_too_long)."""
    rollout_shuffle: bool = False
    """Shuffle the prompts every epoch (seeded by --rollout-seed, so a restart sees the same order)."""
    rollout_seed: int = 42
    """Seed of the per-epoch shuffle."""
    num_epoch: int | None = Field(None, ge=1)
    """Stop handing out prompts after this many passes over the data."""
    streaming_data: bool = False
    """Read datasets lazily in blocks (JSONL byte ranges, Parquet row groups) instead of all at start-up."""
    num_data_workers: int = Field(1, ge=0, le=64)
    """Processes that tokenize prompts ahead of demand; 0 tokenizes in a thread of the service."""
    skip_invalid_rows: bool = False
    """Skip (and count) malformed rows instead of stopping with an error naming the row."""
    data_source_path: str | None = None
    """A custom prompt source class (pkg.mod:Class) with slime's get_samples(n) contract; replaces --prompt-data."""

    # Groups, batches and filters
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    """Responses generated per prompt of an eval set."""
    over_sampling_batch_size: int | None = Field(None, ge=1)
    """Groups that may be in flight for the next step (≥ rollout-batch-size), so that filtered groups are replaced
    without waiting; defaults to rollout-batch-size."""
    dynamic_sampling_filter_path: str | None = None
    """Group filter applied on submit, slime's contract fn(args, samples) -> bool or an object with keep/reason;
    built in: services.buffer.filters:check_reward_nonzero_std."""
    buffer_filter_path: str | None = None
    """Selects a step's groups from the completed ones, slime's contract fn(args, rollout_id, buffer, num_samples);
    default: oldest first."""
    max_staleness: int = Field(0, ge=0)
    """How many policy versions a group may lag the step that trains it (0: synchronous; 1: one step overlap)."""
    stale_policy: Literal["drop", "mark"] = "drop"
    """Groups past the staleness bound are dropped (counted) or trained with their version visible to the trainer."""
    max_buffered_groups: int | None = Field(None, ge=1)
    """Cap on leased plus completed groups; at the cap leases return none (backpressure) until batches drain."""
    balance_data: bool = True
    """Split each step's groups across data-parallel ranks balanced by token count."""
    default_lease_seconds: float = Field(600.0, gt=0)
    """Lease length of a LeasePrompts or ExtendLease call that asks for none (the gateway asks for its
    --lease-seconds); a worker extends its leases while it works, an expired lease returns the group."""
    batch_timeout_s: float = Field(600.0, gt=0)
    """Default wait of GetBatch for enough eligible groups."""
    expire_interval_s: float = Field(1.0, gt=0)
    """How often expired leases are returned to the pool."""

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_id

    @property
    def groups_in_flight(self) -> int:
        return max(self.over_sampling_batch_size or 0, self.rollout_batch_size)

    def eval_sets(self) -> EvalSets:
        """The eval sets, from --eval-config, else --eval-prompt-data."""
        return eval_sets.read(self.eval_config, tuple(self.eval_prompt_data))

    def samples_per_eval_prompt(self) -> dict[str, int]:
        return {s.name: s.n_samples_per_eval_prompt or self.n_samples_per_eval_prompt for s in self.eval_sets()}

    @model_validator(mode="after")
    def _check_sources(self) -> "BufferConfig":
        if len(self.eval_prompt_data) % 2:
            raise ValueError("eval_prompt_data takes name/path pairs, e.g. --eval-prompt-data aime aime.jsonl")
        names = self.eval_prompt_data[::2]
        for name in names:
            if not name or ":" in name or name == "train":
                raise ValueError(f"eval set name {name!r} must be non-empty, without ':' and not 'train'")
        if len(set(names)) != len(names):
            raise ValueError("eval_prompt_data names must be unique")
        self.eval_sets()  # a bad file stops here, naming the set and the key
        if self.eval_config is not None and self.eval_prompt_data:
            log.warning("--eval-config lists the eval sets: --eval-prompt-data is ignored, as in slime")
        needs_tokenizer = self.prompt_data or self.eval_prompt_data or self.eval_config or self.data_source_path
        if needs_tokenizer and not self.hf_checkpoint:
            raise ValueError("hf_checkpoint is required to tokenize prompts; pass --hf-checkpoint <model folder>")
        return self
