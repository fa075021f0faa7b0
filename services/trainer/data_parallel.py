"""Data parallelism through megatron-core: its DistributedDataParallel holds each trained model's gradients in
contiguous buckets and sums them over the data-parallel ranks (bucket by bucket during the backward with
`--overlap-grad-reduce`); with `--use-distributed-optimizer` its DistributedOptimizer shards AdamW's moments and the
float32 main weights over those ranks (ZeRO-1): each rank updates its shard, and the ranks gather the new weights."""

import warnings

import torch

from services.trainer.config import OptimizerSettings, TrainerConfig
from services.trainer.optimizer import build_optimizer, build_scheduler


def build(model: torch.nn.Module, config: TrainerConfig, settings: OptimizerSettings):
    """`(ddp, optimizer, scheduler)` for training `model` with `settings` (the policy's are `config.optimizer`; the
    critic's have its own lr): megatron's DDP around it, then torch's AdamW over its parameters, or megatron's
    DistributedOptimizer with `--use-distributed-optimizer` (which needs the DDP's buffers, so the wrapper comes
    first), and the lr schedule of `optimizer.build_scheduler`."""
    ddp = wrap(model, config)
    s = settings
    schedule = (s.lr_warmup_iters, config.lr_decay_steps(s), s.lr_decay_style, s.lr, s.min_lr)
    if config.use_distributed_optimizer:
        optimizer = DistributedAdamW(ddp, config, settings)
        return ddp, optimizer, Schedulers([build_scheduler(inner, *schedule) for inner in optimizer.inner])
    optimizer = build_optimizer(model, s.lr, s.weight_decay, (s.adam_beta1, s.adam_beta2), s.adam_eps)
    return ddp, optimizer, build_scheduler(optimizer, *schedule)


def wrap(model: torch.nn.Module, config: TrainerConfig):
    """megatron-core's DistributedDataParallel around `model` (a GPTModel): from now on its backward accumulates into
    each parameter's `main_grad`, a view of the DDP's buffer, and `finish_grad_sync()` sums them over the ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    settings = DistributedDataParallelConfig(
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        use_distributed_optimizer=config.use_distributed_optimizer,
        bucket_size=config.ddp_bucket_size,
        grad_reduce_in_fp32=config.bf16,  # as megatron's training does for bf16: gradients add up in float32
    )
    ddp = DistributedDataParallel(model.config, settings, model)
    # Each micro-batch's loss is already scaled by its share of the whole step over all data-parallel ranks, so the
    # reduction is a plain sum, as megatron's is with calculate_per_token_loss (whose division by the step's token
    # count the actor has done); megatron would otherwise scale every gradient by 1 / DP first.
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        buffer.gradient_scaling_factor = 1.0
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor = 1.0
    return ddp


class DistributedAdamW:
    """megatron-core's DistributedOptimizer (AdamW; no weight decay on 1-D parameters and biases, as
    `optimizer.build_optimizer`) behind the interface the actor and the checkpoints use. It clips the gradients to
    `--clip-grad` itself, by the norm over every rank's shard, which `step()` returns. Its `state_dict()` is this rank's
    shard only: each data-parallel rank saves its own (`checkpoint.optimizer_shard_name`)."""

    def __init__(self, ddp, config: TrainerConfig, settings: OptimizerSettings):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        same_names = {"lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"}
        megatron_settings = OptimizerConfig(
            **settings.model_dump(include=same_names),
            bf16=config.bf16,
            use_distributed_optimizer=True,
            overlap_param_gather=config.overlap_param_gather,
        )
        self.megatron = get_megatron_optimizer(megatron_settings, [ddp], use_gloo_process_groups=False)
        self.parts = self.megatron.chained_optimizers  # one for the dense parameters, one for the experts (MoE)
        self.inner = [part.optimizer for part in self.parts]  # torch's AdamW over each part's main-weight shards
        # megatron's own scheduler would apply its no-decay groups' wd_mult at every step; the LambdaLR sets only lr.
        for group in self.param_groups:
            group["weight_decay"] = settings.weight_decay * group["wd_mult"]

    @property
    def param_groups(self) -> list[dict]:
        return self.megatron.param_groups

    def reload_model_params(self) -> None:
        """The float32 main weights take the model's weights again (after weights were loaded into the model)."""
        self.megatron.reload_model_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with warnings.catch_warnings():  # megatron also clears its float32 shards, views whose .grad torch warns about
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf Tensor")
            self.megatron.zero_grad(set_to_none)

    def step(self) -> float:
        """Copies this rank's shard of the summed gradients to float32, clips, steps AdamW on the shard and gathers
        the updated weights from every rank (bucket by bucket in the next forward with `--overlap-param-gather`);
        returns the gradient norm before clipping."""
        _, grad_norm, _ = self.megatron.step()
        return float(grad_norm)

    def state_dict(self) -> dict:
        """This rank's shard, per part: torch's AdamW state of its shards (moments, step, param groups), the float32
        main weights themselves, and the bucket layout they were cut from (it depends on the data-parallel size)."""
        return {
            "parts": [
                {
                    "adamw": part.optimizer.state_dict(),
                    "layout": part.per_bucket_numel,
                    "main_weights": [weight.detach().clone() for weight in _main_weights(part)],
                }
                for part in self.parts
            ]
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if len(state["parts"]) != len(self.parts):
            raise ValueError(f"the optimizer shard has {len(state['parts'])} parts, this model {len(self.parts)}")
        for part, saved in zip(self.parts, state["parts"], strict=True):
            if saved["layout"] != part.per_bucket_numel:
                raise ValueError(
                    "the optimizer shard was cut from other gradient buckets (another data-parallel "
                    "size or --ddp-bucket-size?): resume with the settings it was saved with"
                )
            part.optimizer.load_state_dict(saved["adamw"])
            for weight, value in zip(_main_weights(part), saved["main_weights"], strict=True):
                weight.copy_(value)


def _main_weights(part) -> list[torch.Tensor]:
    return [weight for group in part.optimizer.param_groups for weight in group["params"]]


class Schedulers:
    """The lr schedule over each part of a DistributedAdamW (LambdaLR drives one torch optimizer)."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> list[dict]:
        return [scheduler.state_dict() for scheduler in self.schedulers]

    def load_state_dict(self, states: list[dict]) -> None:
        for scheduler, state in zip(self.schedulers, states, strict=True):
            scheduler.load_state_dict(state)
