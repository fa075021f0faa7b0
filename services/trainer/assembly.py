"""The trainer's parts, each built from its config: the models (policy, frozen reference, PPO critic), the process
groups a step reduces over, this rank's checkpoint shards, the buffer's clients and the weight sender. `Trainer`
(`loop.py`) calls them in order."""

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from services.common.clients import Credentials, open_channel
from services.common.redis_connection import open_redis
from services.trainer import checkpoint, data_parallel
from services.trainer.actor import Groups
from services.trainer.config import TrainerConfig
from services.trainer.parallel import ParallelInfo, control_group, init_parallel
from slipstream.v1 import buffer_pb2_grpc


def parallel_layout(config: TrainerConfig) -> ParallelInfo:
    """This process's place in the tensor-, pipeline-, expert- and data-parallel groups, which it joins; the batch
    sizes must split over its data-parallel ranks."""
    info = init_parallel(seed=config.seed, layout=config.parallel)
    config.batch_sizes(info.dp_size).check()
    return info


# The models


def model_dtype(config: TrainerConfig) -> torch.dtype:
    return torch.bfloat16 if config.bf16 else torch.float32


def model_settings(config: TrainerConfig) -> dict:
    """The TransformerConfig settings the policy and the critic train with (the reference only runs forward)."""
    settings = {"sequence_parallel": config.parallel.sequence_parallel}
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(config, name) is not None:
            settings[name] = getattr(config, name)
    if config.replays_routing:
        settings["moe_enable_routing_replay"] = True
    if config.recompute_activations:
        settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return settings


def load_policy(config: TrainerConfig):
    """The policy's (GPTModel, GPTConfig), from --hf-checkpoint; an MoE model's settings are checked against it."""
    from services.trainer.models import load_gpt_model

    # Where torch's AdamW keeps float32 masters of the bf16 weights (optimizer.MasterAdamW), they start from a float32
    # checkpoint's own values; megatron's distributed optimizer makes its own from the bf16 weights.
    masters = config.bf16 and not config.use_distributed_optimizer and not config.lora_rank
    model, gpt = load_gpt_model(
        config.hf_checkpoint, dtype=model_dtype(config), keep_float32=masters, **model_settings(config)
    )
    if config.lora_rank:
        from services.trainer import lora

        lora.apply(model, lora.settings_of(config), gpt.shape)
    if config.replays_routing and not gpt.shape.num_experts:
        raise ValueError(
            f"routing replay replays the experts' routing: {config.hf_checkpoint} has no experts "
            "(a dense model); drop --use-routing-replay / --use-rollout-routing-replay"
        )
    layout = config.parallel
    if gpt.shape.num_experts and layout.tensor_model_parallel_size > 1 and not layout.sequence_parallel:
        raise ValueError(
            "an MoE model trains with tensor parallelism only under sequence parallelism (megatron's "
            "MoE layer splits the tokens over the TP ranks): add --sequence-parallel"
        )
    return model, gpt


def load_reference(config: TrainerConfig):
    """The frozen reference the KL is taken against (None without a KL loss or penalty, and with LoRA, whose
    reference is the policy with its adapters off)."""
    if not (config.loss.use_kl_loss or config.kl_coef) or config.lora_rank:
        return None
    from services.trainer.models import load_gpt_model

    reference, _ = load_gpt_model(config.hf_checkpoint, dtype=model_dtype(config))
    return reference.eval().requires_grad_(False)


def load_teacher(config: TrainerConfig, model_shard: str):
    """On-policy distillation's teacher with --opd-type megatron (None otherwise): the policy's architecture, with the
    weights of --opd-teacher-load (an HF folder, or this rank's shard `model_shard` of a --save folder), frozen."""
    if not (config.use_opd and config.opd_type == "megatron"):
        return None
    from services.trainer.models import SafetensorsWeights, load_gpt_model, load_hf_weights

    teacher, gpt = load_gpt_model(config.hf_checkpoint, dtype=model_dtype(config))
    folder = Path(config.opd_teacher_load)
    if checkpoint.latest_step(folder) is None and config.opd_teacher_ckpt_step is None:
        load_hf_weights(teacher, gpt, SafetensorsWeights(folder))
    else:
        state = checkpoint.load(folder, model_shard, step=config.opd_teacher_ckpt_step, rng=False)
        teacher.load_state_dict(state["model"])
    return teacher.eval().requires_grad_(False)


def load_critic(config: TrainerConfig, groups: Groups):
    """PPO's critic, with its own optimizer and schedule (None for the other advantage estimators)."""
    if config.loss.advantage_estimator != "ppo":
        return None
    from services.trainer import critic

    model, _ = critic.load_critic(config.hf_checkpoint, model_dtype(config), **model_settings(config))
    settings = config.optimizer.model_copy(update={"lr": config.critic_lr or config.optimizer.lr})
    ddp, optimizer, scheduler = data_parallel.build(model, config, settings)
    return critic.Critic(config, model, optimizer, scheduler, groups, ddp=ddp)


# Where a step reduces, and what a checkpoint holds of this rank


def process_groups(info: ParallelInfo, shape) -> Groups:
    """The groups the actor's and the critic's steps reduce over, and the part of the vocabulary this rank's output
    layer holds (`shape`: the policy's)."""
    from megatron.core import parallel_state

    local_vocab = shape.padded_vocab_size // info.tp_size
    return Groups(
        dp=parallel_state.get_data_parallel_group(),
        tp=parallel_state.get_tensor_model_parallel_group(),
        tp_rank=info.tp_rank,
        vocab_start=info.tp_rank * local_vocab if info.tp_size > 1 else None,
        vocab_size=shape.vocab_size,
        model_parallel=parallel_state.get_model_parallel_group(),
        expert_model_parallel=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
        embedding=_tied_embedding_group(shape),
    )


def _tied_embedding_group(shape):
    """The first and last pipeline stages of this rank's pipeline, where a tied embedding has its two copies."""
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if not shape.tie_word_embeddings or stages == 1 or not parallel_state.is_rank_in_embedding_group():
        return None
    return parallel_state.get_embedding_group()


@dataclass(frozen=True)
class Shards:
    """This rank's files in a checkpoint: its model shard, which it writes or not, and with the distributed
    optimizer its own optimizer shard."""

    model: str
    writes: bool
    optimizer: str | None = None


def checkpoint_shards(config: TrainerConfig, info: ParallelInfo) -> Shards:
    from megatron.core import parallel_state

    model = checkpoint.shard_name(info.tp_rank, info.pp_rank, info.ep_rank)
    # One rank of each shard writes it: replica 0's, and with experts those holding replica 0's experts.
    writes = info.dp_rank == 0 or (info.ep_rank is not None and parallel_state.get_expert_data_parallel_rank() == 0)
    # With the distributed optimizer each data-parallel rank also writes its own optimizer shard.
    optimizer = checkpoint.optimizer_shard_name(model, info.dp_rank) if config.use_distributed_optimizer else None
    return Shards(model, writes, optimizer)


# The clients


def buffer_client(config: TrainerConfig) -> tuple[grpc.Channel, buffer_pb2_grpc.BufferServiceStub]:
    channel = open_channel(config.buffer_addr, Credentials.of(config, "trainer"))
    return channel, buffer_pb2_grpc.BufferServiceStub(channel)


def data_plane(config: TrainerConfig):
    """The buffer's Redis, where the batches' arrays are read (None: they come in the buffer's replies)."""
    if not config.redis.url:
        return None
    # The arrays are values of megabytes: read a megabyte at a time (a third faster than redis-py's 64 KiB).
    return open_redis(config.redis, Path(".")).client(socket_read_size=1 << 20)


def weight_sender(config: TrainerConfig, info: ParallelInfo, model, gpt):
    """What sends the policy's weights to the engines on this rank (None without engines, or where this rank has no
    part in it). The ranks of data-parallel replica 0 gather the weights for the senders (each pipeline stage's first
    rank); with expert parallelism the experts live on every data-parallel rank, so every rank takes part; colocated,
    every rank hands its copy to the engines on its GPU."""
    from megatron.core import parallel_state

    all_ranks = config.parallel.expert_model_parallel_size > 1 or (config.colocate and info.world_size > 1)
    if config.colocate and info.world_size != int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)):
        raise ValueError("--colocate hands tensors over by CUDA IPC, within one node: run the trainer on one node")
    if not config.rollout_addr or not (info.dp_rank == 0 or all_ranks):
        return None
    from services.trainer.models import WeightViews, hf_weights_of
    from services.trainer.weight_sync import WeightSender

    model_parallel = info.tp_size * config.parallel.pipeline_model_parallel_size > 1
    peers = parallel_state.get_model_parallel_group() if model_parallel else None
    peers = control_group() if all_ranks else peers  # its decisions only: no tensor goes over it
    sender = info.dp_rank == 0 and info.tp_rank == 0
    stages = config.parallel.pipeline_model_parallel_size > 1
    senders = parallel_state.get_pipeline_model_parallel_group() if sender and stages else None
    if config.lora_rank:  # only the adapters travel (services/trainer/transports/lora.py)
        from services.trainer.lora import adapter_tensors

        weights, views = lambda: adapter_tensors(model, gpt.shape).items(), None
    else:
        weights, views = lambda: hf_weights_of(model, gpt), WeightViews(model, gpt)
    return WeightSender(config, weights, sender=sender, peers=peers, senders=senders, views=views)
