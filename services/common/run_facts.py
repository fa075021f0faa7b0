"""The run's facts: the settings that several services must agree on, declared here once and embedded whole in every
service's config (`run: RunConfig`, a flat group: its flags keep slime's names). `slipstream train` and a run file
give them to every service, so that no two can disagree."""

from pathlib import Path
from typing import Literal

from pydantic import Field

from services.common.config import StrictModel

RUN_ID = r"^[A-Za-z0-9_.-]+$"  # a run's name: its Redis namespace and folder


class RunConfig(StrictModel):
    flat = True

    run_id: str = Field("default", pattern=RUN_ID)
    """Name of the run: its Redis namespace, its folder under the buffer's --output-dir, and the name under which its
    gateways meet in Redis."""
    buffer_addr: str = "localhost:50051"
    """The run's buffer service (host:port): the gateway leases prompt groups there and hands in finished ones, the
    trainer takes each step's batch."""
    hf_checkpoint: str = ""
    """HF checkpoint folder: the trainer builds the model from its config and starts from its weights; the buffer
    tokenizes prompts with its tokenizer and chat template; engines the gateway launches serve it, and custom generate
    functions get its tokenizer."""
    rollout_batch_size: int = Field(32, ge=1)
    """Prompt groups per training step (a rollout function reads it as args.rollout_batch_size)."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses generated per prompt: the size of a group."""
    num_rollout: int | None = Field(None, ge=1)
    """Training steps (rollouts) of the run; no prompts are handed out beyond what they need, and unset trains until
    the buffer runs out."""
    rm_type: str = ""
    """Reward type: a built-in verifier (math, deepscaler, dapo, gsm8k, exact, f1, multiple_choice, reasoning_gym,
    random; a boxed_ prefix extracts \\boxed{} first), remote_rm (HTTP, --rm-url) or remote_grpc (--rm-grpc-addr);
    unset, the reward service's default, math. The gateway asks the reward service for it (unset: for the service's
    own); an item's rm_type (also metadata.rm_type, as an eval set sets it) overrides it."""
    group_rm: bool = False
    """Score each group with one ScoreGroup call (a --custom-rm-path that sees the whole group, e.g. a pairwise
    judge), as slime's --group-rm; off, samples are scored one by one (in one Score call per group)."""
    eval_config: Path | None = None
    """slime's multi-task evaluation file (YAML; services/common/eval_sets.py): each set's path, keys, reward type,
    samples per prompt and sampling, which override the --eval-* settings for that set (and its
    custom_generate_function_path the gateway's); given, --eval-prompt-data is ignored (as in slime)."""
    lora_rank: int = Field(0, ge=0)
    """LoRA: train low-rank adapters of this rank on the --target-modules layers, the base weights frozen (0: train
    every weight). Each sync is an adapter (a peft folder under --update-weight-disk-dir) that the engines load under a
    name of this run and version, and every request asks for the live one; engines the gateway launches get SGLang's
    --enable-lora, --max-lora-rank and --lora-target-modules (docs/trainer.md and docs/rollout.md, "LoRA")."""
    target_modules: list[str] = ["all-linear"]
    """The layers LoRA adapts, by HF's names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all-linear
    (the engines' --lora-target-modules)."""
    update_weight_disk_dir: str | None = None
    """With --update-weight-transport disk (or --lora-rank): the folder, shared with the engines, that each sync's
    checkpoint is written into (`weight_v000042/`, renamed into place once complete) and the engines load from
    (/update_weights_from_disk, /load_lora_adapter). Where the engines see it elsewhere, give the gateway that path."""
    update_weight_transport: str = "auto"
    """How the weights travel, decided once for the run, checked by the trainer and the gateway as they load their
    settings (services/weightsync/factory.py) and confirmed by the gateway at each sync: `auto` (LoRA adapters with
    --lora-rank, the tensors' CUDA IPC handles with --colocate, else a weight group: streamed through the weight
    receivers where the gateway has them, else broadcast), or one by name: `broadcast`, `streamed`, `handles`, `lora`,
    or `disk` (an HF checkpoint written under --update-weight-disk-dir at each sync, which the engines load through
    /update_weights_from_disk: for engines the trainer's network cannot reach). `nccl` is `auto`."""
    update_weight_mode: Literal["full", "delta"] = "full"
    """`delta`: a sync sends only the 2-byte words that changed since the engines' version, where every engine holds
    it (a new or restarted engine gets every bucket whole), checked per tensor by checksum. Needs the weight receivers
    (the gateway's --weight-receiver-port-offset; a gateway that starts its engines starts their receivers at offset
    1); keeps a copy of the model's weights on the trainer's GPU and one beside each engine's (docs/rollout.md, "Delta
    sync")."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """Deadline of each step of a weight sync: joining the group, each bucket, each engine call, the commit. An engine
    past it is evicted and the sync goes on without it; the trainer's own waits are a multiple of it."""
    use_opd: bool = False
    """On-policy distillation (slime's): each response token's advantage less --opd-kl-coef * (the policy's log-prob
    - the teacher's), on top of any estimator; needs --opd-type."""
    opd_type: Literal["sglang", "megatron"] | None = None
    """Where the teacher's log-probs come from: `sglang`, teacher engines the gateway asks as it finishes each group
    (--opd-teacher-urls or --opd-teacher-hf-checkpoint; they come with the batch); `megatron`, a teacher model the
    trainer loads (--opd-teacher-load) and runs forward on each batch, as the reference model."""
    use_rollout_routing_replay: bool = False
    """MoE: every /generate asks the engine for the experts it routed each token to (SGLang's return_routed_experts;
    engines the gateway launches get --enable-return-routed-experts), and the training forwards (the old policy's
    log-probs too) route each token to them."""
