"""Configuration of the trainer. Names are Megatron's (`--tensor-model-parallel-size`, `--lr`, `--clip-grad`, …) and
slime's (`--advantage-estimator`, `--use-kl-loss`, …), so a slime command line carries over."""

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.common.config import ServiceConfig, StrictModel
from services.common.redis_connection import RedisConfig
from services.common.run_facts import RunConfig
from services.trainer.batching import BatchSizeError, BatchSizes
from services.weightsync import factory


class LossSettings(StrictModel):
    """The actor's loss: what `losses.policy_loss` takes whole. A flat group: its flags and config-file keys are
    slime's (`--eps-clip`, `eps_clip:`), not prefixed."""

    flat: ClassVar[bool] = True

    advantage_estimator: Literal[
        "grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
    ] = "grpo"
    """How rewards become advantages."""
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    """The actor's loss; custom_loss is --custom-loss-function-path's."""
    eps_clip: float = Field(0.2, ge=0)
    """PPO clip range (lower side, and upper side unless --eps-clip-high)."""
    eps_clip_high: float | None = Field(None, ge=0)
    """Upper clip range (DAPO's clip-higher)."""
    eps_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant for negative advantages."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL to the frozen reference model (the --hf-checkpoint weights) to the loss."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of the KL loss."""
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator of the KL loss."""
    use_tis: bool = False
    """Truncated importance sampling between the trainer's and the engine's log-probs."""
    tis_clip: float = Field(2.0, gt=0)
    """Upper clip of the TIS weights."""
    tis_clip_low: float = Field(0.0, ge=0)
    """Lower clip of the TIS weights."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as the old policy's instead of recomputing them."""
    use_unbiased_kl: bool = False
    """Weigh the KL loss by each token's importance ratio to the old policy (DeepSeek-V3.2's unbiased estimate)."""
    use_opsm: bool = False
    """Off-policy sequence masking: no policy loss on the negative-advantage tokens of a sample that drifted more than
    --opsm-delta from the old policy."""
    opsm_delta: float = 1e-4
    """OPSM's bound on a sample's mean of old minus new log-probs over its trained tokens."""


class OptimizerSettings(StrictModel):
    """AdamW, its learning-rate schedule and the gradient clipping: what `data_parallel.build` takes whole to build a
    model's optimizer and scheduler. A flat group: its flags and config-file keys are Megatron's (`--lr`, `lr:`)."""

    flat: ClassVar[bool] = True

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0)
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = Field(0, ge=0)
    """Steps of linear warmup."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after the warmup."""
    lr_decay_iters: int | None = Field(None, ge=1)
    """Steps over which the lr decays to --min-lr."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (not on norms and biases)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    clip_grad: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0: off)."""


class ParallelSettings(StrictModel):
    """How the model is split over the ranks: what `parallel.init_parallel` takes whole. A flat group: its flags and
    config-file keys are Megatron's (`--tensor-model-parallel-size`, `tensor_model_parallel_size:`)."""

    flat: ClassVar[bool] = True

    tensor_model_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Pipeline-parallel size."""
    expert_model_parallel_size: int = Field(1, ge=1)
    """Expert-parallel size (MoE): each rank of an expert group holds num_experts / this of every layer's experts;
    carved out of the data-parallel ranks, as in Megatron."""
    expert_tensor_parallel_size: int | None = Field(None, ge=1)
    """Tensor-parallel size of each expert (MoE); unset: the tensor-parallel size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (with TP > 1)."""

    @model_validator(mode="after")
    def _check(self) -> "ParallelSettings":
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel splits sequences over tensor-parallel ranks: it needs TP > 1")
        return self


class TrainerConfig(ServiceConfig):
    """The trainer: a Megatron-core actor that pulls its batches from the buffer, under torchrun."""

    run: RunConfig = RunConfig()  # the run's facts, as every service has them (services/common/run_facts.py)

    port: int = Field(50054, ge=0, le=65535)
    """gRPC port of rank 0's control surface; 0 picks a free one (logged at start)."""
    redis: RedisConfig = RedisConfig()
    """With --redis-url (the buffer's Redis), the trainer reads its batches' token arrays from Redis itself instead
    of through the buffer (the buffer hands out their keys). Unset: the arrays come with GetBatch."""
    rollout_addr: str | None = None
    """The rollout gateway (host:port): after each --update-weights-interval steps the weights go to its engines.
    Unset, no weights are sent and the trainer sets the buffer's policy version itself."""
    update_weights_interval: int = Field(1, ge=1)
    """Send the weights every this many steps."""
    update_weight_buffer_size: int = Field(512 * 1024**2, ge=1)
    """Bytes of weights per bucket of a weight sync (slime's unit)."""
    update_weight_flattened_bucket: bool = False
    """Send each bucket as one flattened uint8 tensor (SGLang's flattened_bucket) instead of tensor by tensor."""
    update_weight_buckets_in_flight: int = Field(2, ge=1)
    """Weight buckets sent before the first of them is answered. Engines that take ordered buckets (the reference
    engine) receive the next while they load one; SGLang engines take one at a time. Each costs a bucket of memory on
    the trainer, and on those engines."""
    update_weight_disk_keep_files: bool = False
    """Keep each sync's checkpoint folder once the engines loaded it (by default it is removed then)."""
    weight_sync_address: str = "127.0.0.1"
    """Address at which the engines reach this trainer's rank 0 to join the weight group."""
    colocate: bool = False
    """Trainer and engines share the GPUs: the engines free their memory while the trainer trains, and weights go as
    CUDA IPC handles (/update_weights_from_tensor) instead of a broadcast. Needs --rollout-addr and a sync each step."""
    offload_rollout: bool = True
    """With --colocate, the engines free their GPU memory while the trainer trains and take it back at the sync
    (slime's --offload-rollout, on by default with --colocate). `--no-offload-rollout` keeps them resident, where the
    GPU holds both: a small model's engine then keeps its decode graphs from step to step instead of capturing them
    again after each release."""

    # Model and checkpoints
    load: str | None = None
    """A checkpoint folder written by --save to resume from exactly, or an HF folder to start from."""
    save: str | None = None
    """Folder for checkpoints (model, optimizer, scheduler, RNG, step, policy version)."""
    save_interval: int | None = Field(None, ge=1)
    """Save every this many steps (and at the end); unset saves only at the end and when asked."""
    save_hf: str | None = None
    """Also write an HF checkpoint folder here whenever a checkpoint is saved."""

    # Parallelism (Megatron's names)
    parallel: ParallelSettings = ParallelSettings()
    """The parallel layout (flags --tensor-model-parallel-size, --sequence-parallel, …: Megatron's names, no
    prefix)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] | None = None
    """The MoE routers' load-balancing loss; unset: the family's (Qwen3-MoE: aux_loss; DeepSeek-V3, GLM-4.5: none)."""
    moe_aux_loss_coeff: float | None = Field(None, ge=0)
    """Weight of that loss; unset: the checkpoint's (Qwen3-MoE: router_aux_loss_coef)."""
    moe_z_loss_coeff: float | None = Field(None, ge=0)
    """Weight of the routers' z-loss (megatron's); unset: none."""
    use_routing_replay: bool = False
    """MoE: the training forward routes each token to the experts the old policy chose for it (recorded while
    computing the old log-probs), so an update changes the experts' weights but not which experts answer."""
    recompute_activations: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them."""
    bf16: bool = False
    """Train in bfloat16 (on GPU)."""
    compile_model: bool = False
    """torch.compile the decoder layers (an MoE layer's attention) and the log-prob chunks (fuses norms, rotary
    embeddings, activations and the log-softmax; worth it on GPU: see docs/BENCHMARKS.md)."""
    log_probs_chunk_size: int = Field(4096, ge=1)
    """Response tokens whose full-vocabulary log-softmax is formed at once."""
    log_probs_from_hidden: bool | None = None
    """Log-probs and entropy streamed over the vocabulary from the last hidden states and the output layer's weight
    (services/trainer/linear_logprobs.py): no logits of a whole micro-batch, only of the response positions and
    VOCAB_CHUNK words at a time. Off: the output layer's logits, --log-probs-chunk-size rows at a time. Unset: on where
    the trainer runs on GPUs, unless a LoRA adapter sits on the output layer (lm_head in --target-modules)."""
    seed: int = 1234
    """Seed of initialisation, dropout and data order."""

    # Batches (slime's names and constraint)
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step, across data-parallel ranks; unset, a rollout's samples / --num-steps-per-rollout."""
    num_steps_per_rollout: int | None = Field(None, ge=1)
    """Optimizer steps per rollout; unset, a rollout's samples / --global-batch-size, as slime works it out
    (--global-batch-size 128 with --rollout-batch-size 32 x --n-samples-per-prompt 8: two steps a rollout)."""
    micro_batch_size: int = Field(1, ge=1)
    """Samples per micro-batch (without --use-dynamic-batch-size)."""
    use_dynamic_batch_size: bool | None = None
    """Micro-batches of as many samples as fit in --max-tokens-per-gpu (padded) tokens. Unset: on where the trainer
    runs on GPUs with one pipeline stage and --micro-batch-size is not given, else --micro-batch-size samples."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """Token budget of one micro-batch with --use-dynamic-batch-size. Unset: what the free GPU memory holds once the
    model and optimizer are in place (services/trainer/token_budget.py; the trainer logs it)."""

    # Algorithm (slime's names)
    disable_grpo_std_normalization: bool = False
    """Dr.GRPO: subtract the group mean only."""
    normalize_advantages: bool = False
    """Whiten advantages over the batch's trained tokens."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of reinforce++ and PPO returns."""
    lambd: float = Field(1.0, ge=0, le=1)
    """GAE lambda (PPO)."""
    value_clip: float = Field(0.2, ge=0)
    """Clip range of the PPO critic's value loss."""
    num_critic_only_steps: int = Field(0, ge=0)
    """PPO: train only the critic for this many first rollouts."""
    critic_lr: float | None = Field(None, gt=0)
    """PPO: the critic's learning rate; unset takes --lr."""
    custom_loss_function_path: str | None = None
    """With --loss-type custom_loss: slime's fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)."""
    custom_advantage_function_path: str | None = None
    """slime's fn(args, rollout_data): sets rollout_data["advantages"] and ["returns"] instead of the estimator."""
    custom_tis_function_path: str | None = None
    """With --use-tis: slime's fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, ...) ->
    (pg_loss, loss_masks, metrics) instead of the truncated importance sampling."""
    custom_reward_post_process_path: str | None = None
    """slime's fn(args, samples) -> (raw_rewards, rewards): the rewards the estimator gets, instead of the group
    normalization."""
    custom_convert_samples_to_train_data_path: str | None = None
    """slime's fn(args, samples) -> dict (tokens, response_lengths, loss_masks, rewards, raw_reward, ...): the
    step's training data from its samples; its rewards are taken as normalized."""
    custom_rollout_log_function_path: str | None = None
    """slime's fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, called with each step's
    samples (rank 0's); True skips the step's TensorBoard scalars."""
    max_reward_failures: float = Field(0.5, ge=0, le=1)
    """Stop the run when more than this share of a step's samples have no reward (the reward function raised, timed
    out, or could not score the problem), rather than train on the rest; each step's share is its `reward_failed`
    metric. 1 never stops."""
    disable_rewards_normalization: bool = False
    """Train on the rewards as scored: no group mean (or std) is taken before the estimator."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty in the reward (reinforce++ and PPO)."""
    lora_alpha: float = Field(16.0, gt=0)
    """The adapters' scale is lora_alpha / lora_rank (peft's)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    opd_kl_coef: float = 1.0
    """Weight of the distillation term in the advantages."""
    opd_teacher_load: str | None = None
    """With --opd-type megatron: the teacher, of the policy's architecture: an HF folder, or a folder written by
    --save (its latest step, or --opd-teacher-ckpt-step)."""
    opd_teacher_ckpt_step: int | None = Field(None, ge=0)
    """The step of --opd-teacher-load's checkpoint to load (default: its latest)."""
    loss: LossSettings = LossSettings()
    """The actor's loss (flags --eps-clip, --use-kl-loss, …: slime's names, no prefix)."""
    calculate_per_token_loss: bool = True
    """Average the loss over all trained tokens of the batch (slime's flag); off, over each sample then samples."""

    # Optimizer (Megatron's names)
    optimizer: OptimizerSettings = OptimizerSettings()
    """AdamW, its schedule and the gradient clipping (flags --lr, --clip-grad, …: Megatron's names, no prefix)."""
    use_distributed_optimizer: bool = False
    """Shard AdamW's moments and the float32 main weights over the data-parallel ranks (megatron-core's
    DistributedOptimizer, ZeRO-1): each rank keeps, updates and saves its 1/DP of them."""
    overlap_grad_reduce: bool = False
    """Sum each bucket of gradients over the data-parallel ranks as soon as the backward has produced it (megatron's
    DDP), overlapping that communication with the rest of the backward."""
    overlap_param_gather: bool = False
    """With --use-distributed-optimizer: gather each bucket of updated weights during the next forward instead of all
    of them right after the step (the trainer gathers the rest before it syncs or saves them)."""
    ddp_bucket_size: int | None = Field(None, ge=1)
    """Parameters per gradient bucket with --overlap-grad-reduce; unset: megatron's max(40M, 1M x DP size)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard logs here."""
    log_samples: int = Field(0, ge=0)
    """Show this many prompts a step, each with a response and its reward: on the console (`slipstream train`), in
    TensorBoard as text and in W&B as a table (TRL's log_completions). 0: none."""
    load_debug_rollout_data: str | None = None
    """Train on batches saved by a --debug-rollout-only run (a path with {rollout_id}) instead of the buffer's; the
    run ends at the first step without a file."""
    steps_file: str | None = None
    """Append one JSON line per step here: step, policy version, the trained group ids, the metrics and the step's
    time split (what `slipstream train` shows and plots)."""

    @property
    def replays_routing(self) -> bool:
        return self.use_routing_replay or self.use_rollout_routing_replay

    def lr_decay_steps(self, settings: OptimizerSettings) -> int | None:
        """Optimizer steps over which `settings`' lr decays: --lr-decay-iters, else (megatron's and slime's default) the
        run's, --num-rollout x --num-steps-per-rollout."""
        if settings.lr_decay_iters is not None or self.num_rollout is None:
            return settings.lr_decay_iters
        return self.num_rollout * self.num_steps_per_rollout

    def batch_sizes(self, dp_size: int) -> BatchSizes:
        return BatchSizes(
            self.rollout_batch_size,
            self.n_samples_per_prompt,
            self.global_batch_size,
            self.num_steps_per_rollout,
            dp_size,
            self.micro_batch_size,
        )

    @model_validator(mode="after")
    def _steps_of_a_rollout(self) -> "TrainerConfig":
        """--global-batch-size and --num-steps-per-rollout from each other, or from a rollout's samples, as slime works
        them out; one that does not divide them is left for the batch check to name (batching.BatchSizes.check)."""
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.num_steps_per_rollout is None:
            divides = self.global_batch_size and samples % self.global_batch_size == 0
            self.num_steps_per_rollout = samples // self.global_batch_size if divides else 1
        if self.global_batch_size is None:
            divides = samples % self.num_steps_per_rollout == 0
            self.global_batch_size = samples // self.num_steps_per_rollout if divides else samples
        return self

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.loss.advantage_estimator == "ppo" and self.parallel.pipeline_model_parallel_size > 1:
            raise ValueError("the PPO critic runs without pipeline parallelism: use --pipeline-model-parallel-size 1")
        if self.optimizer.lr_decay_style != "constant" and self.lr_decay_steps(self.optimizer) is None:
            raise ValueError(
                f"--lr-decay-style {self.optimizer.lr_decay_style} decays over --lr-decay-iters steps, or over the "
                "run's steps (--num-rollout x --num-steps-per-rollout): pass one of them"
            )
        if self.colocate and (not self.rollout_addr or self.update_weights_interval != 1):
            raise ValueError(
                "colocate hands the GPU back to the engines at each sync: it needs --rollout-addr and "
                "--update-weights-interval 1"
            )
        if self.colocate and self.update_weight_mode == "delta":
            raise ValueError(
                "--update-weight-mode delta sends changes over the weight group, and colocated engines "
                "share the trainer's tensors by handle: drop one of them"
            )
        if refused := factory.refusal(self.run, colocate=self.colocate):
            raise ValueError(refused)
        if self.update_weight_transport == "disk":
            self._check_disk()
        self._check_opd()
        if self.lora_rank:
            from services.trainer.lora import check_targets

            check_targets(self.target_modules)
            self._check_lora()
        if self.colocate and self.parallel.pipeline_model_parallel_size > 1:
            raise ValueError(
                "--colocate hands every engine's GPU the whole model, and a pipeline stage holds only its "
                "layers: spread the trainer with --tensor-model-parallel-size instead"
            )
        if self.replays_routing and self.parallel.pipeline_model_parallel_size > 1:
            raise ValueError(
                "routing replay records and replays micro-batch by micro-batch outside megatron's "
                "pipeline schedule: use --pipeline-model-parallel-size 1"
            )
        if self.parallel.pipeline_model_parallel_size > 1 and self.use_dynamic_batch_size:
            raise ValueError(
                "pipeline parallelism sends activations of one shape, so micro-batches have --micro-batch-size "
                "samples: drop --use-dynamic-batch-size or use --pipeline-model-parallel-size 1"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "--overlap-param-gather gathers the weights the distributed optimizer updated in shards: "
                "add --use-distributed-optimizer or drop it"
            )
        if (self.loss.loss_type == "custom_loss") != bool(self.custom_loss_function_path):
            raise ValueError("--loss-type custom_loss and --custom-loss-function-path go together: give both, or none")
        if self.custom_loss_function_path and self.parallel.pipeline_model_parallel_size > 1:
            raise ValueError(
                "a custom loss gets the whole model's logits, which only the last pipeline stage has: use "
                "--pipeline-model-parallel-size 1"
            )
        if self.custom_tis_function_path and not self.loss.use_tis:
            raise ValueError("--custom-tis-function-path replaces the TIS weights of --use-tis: add --use-tis")
        try:
            self.batch_sizes(dp_size=1).check()
        except BatchSizeError as e:
            raise ValueError(str(e)) from None
        return self

    def _check_opd(self) -> None:
        if self.use_opd and self.opd_type is None:
            raise ValueError("--use-opd needs --opd-type: sglang (teacher engines) or megatron (--opd-teacher-load)")
        if self.opd_teacher_load is not None and not (self.use_opd and self.opd_type == "megatron"):
            raise ValueError(
                "--opd-teacher-load is the teacher of --use-opd --opd-type megatron: add those, or drop it (with "
                "--opd-type sglang the teacher is served by engines: the gateway's --opd-teacher-urls)"
            )
        if self.use_opd and self.opd_type == "megatron" and not self.opd_teacher_load:
            raise ValueError("--opd-type megatron loads the teacher here: add --opd-teacher-load <HF or --save folder>")
        if self.opd_teacher_load is not None and not Path(self.opd_teacher_load).is_dir():
            raise ValueError(f"--opd-teacher-load {self.opd_teacher_load}: no such folder")

    def _check_lora(self) -> None:
        if self.log_probs_from_hidden and "lm_head" in self.target_modules:
            raise ValueError(
                "--log-probs-from-hidden multiplies out the output layer's weight itself, without an adapter on it: "
                "drop lm_head from --target-modules, or --log-probs-from-hidden"
            )
        if self.rollout_addr and not self.update_weight_disk_dir:
            raise ValueError(
                "--lora-rank sends each sync's adapters as a folder the engines load: add --update-weight-disk-dir "
                "<folder shared with the engines> (`slipstream train` sets one in the run's folder)"
            )
        if self.colocate:
            raise ValueError("--lora-rank with --colocate is not supported: run the engines on GPUs of their own")

    def _check_disk(self) -> None:
        if not self.update_weight_disk_dir:
            raise ValueError(
                "--update-weight-transport disk writes each sync's checkpoint into a folder the engines read: "
                "add --update-weight-disk-dir <folder shared with the engines>"
            )
        if self.colocate:
            raise ValueError(
                "--colocate hands the weights to the engines on the same GPUs by handle: drop "
                "--update-weight-transport disk"
            )
        if self.update_weight_mode == "delta":
            raise ValueError(
                "--update-weight-mode delta sends changes through the weight receivers, not through disk: use "
                "--update-weight-mode full with --update-weight-transport disk"
            )
