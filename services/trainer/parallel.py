"""Brings up (and tears down) the process groups the trainer's Megatron model lives in: torch.distributed from the
torchrun environment (gloo on CPU, nccl on GPU), then megatron's tensor/pipeline-parallel groups."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.trainer.config import ParallelSettings
from services.trainer.cpu_shims import apply_cpu_shims, cuda_available, seed_model_parallel_rng
from services.weightsync.group import apply_nccl_settings


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits: its global rank, the world size, its tensor-parallel rank and size, its pipeline
    stage, its data-parallel rank and size, and its expert-parallel rank (None without expert parallelism)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    device: torch.device
    pp_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int | None = None


_control: "dist.ProcessGroup | None" = None  # gloo over every rank, on GPUs (init_parallel)


def control_group() -> "dist.ProcessGroup":
    """Every rank, for the small decisions they share while the GPUs should be left alone (which batch, stop or save,
    a colocated sync's hand-over): gloo, on the CPU. A rank waiting in an NCCL collective keeps a kernel spinning on its
    GPU, and an engine colocated on that GPU then gets it only in time slices: the second rank, waiting for rank 0's
    decision through the whole rollout, halved its engine's speed."""
    return _control if _control is not None else dist.group.WORLD


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def apply_cpu_threads() -> None:
    """A GPU rank's CPU operators run on one thread, as torchrun sets OMP_NUM_THREADS for each rank when it starts
    several, unless OMP_NUM_THREADS says otherwise. A lone rank would otherwise wake a pool of every core for each small
    operator on the host (a micro-batch's rows of the rollout), and the GPU waits: the Qwen3-30B-A3B-shaped MoE step
    at EP 1 took 0.188-0.197 s with 32 threads against 0.130-0.136 s with one (bench/moe_step.py,
    docs/BENCHMARKS.md)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def init_parallel(
    tp_size: int = 1,
    pp_size: int = 1,
    seed: int = 1234,
    timeout_s: float = 600,
    ep_size: int = 1,
    etp_size: int | None = None,
    *,
    layout: ParallelSettings | None = None,
) -> ParallelInfo:
    """Initialises torch.distributed from torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a single process
    without them becomes a world of one) and megatron's model-parallel groups: tensor, pipeline, and for MoE expert
    (`ep_size`, out of the data-parallel ranks) and expert-tensor (`etp_size`, default `tp_size`). `layout`, the
    trainer's parallel settings, gives those sizes in full; the short ones are for tests and benchmarks. Idempotent
    per process."""
    from megatron.core import parallel_state

    if layout is not None:
        tp_size, pp_size = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        ep_size, etp_size = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size

    apply_cpu_shims()
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    _check_world(world_size, tp_size, pp_size, ep_size, etp_size or tp_size)
    if cuda_available():
        apply_nccl_settings()  # before this process's first communicator: the weight group's members must agree
        apply_cpu_threads()
        local_rank = _env_int("LOCAL_RANK", rank % torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda_available() else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if cuda_available() else None,
            store=_rendezvous_store(world_size),
        )
    global _control
    if cuda_available() and _control is None and world_size > 1:
        _control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=etp_size,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    initialised = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if initialised != (tp_size, pp_size):
        raise ValueError(
            f"model parallelism is already initialised as (TP, PP) = {initialised}, not {(tp_size, pp_size)}"
        )
    seed_model_parallel_rng(seed)
    return ParallelInfo(
        rank=rank,
        world_size=world_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        device=device,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank() if ep_size > 1 else None,
    )


def _check_world(world_size: int, tp_size: int, pp_size: int, ep_size: int, etp: int) -> None:
    if world_size % (tp_size * pp_size) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-parallel size {tp_size} times pipeline-parallel size "
            f"{pp_size}; launch a multiple of {tp_size * pp_size} processes"
        )
    if world_size % (etp * ep_size * pp_size):
        raise ValueError(
            f"world size {world_size} is not divisible by expert-tensor-parallel size {etp} x "
            f"expert-parallel size {ep_size} x pipeline-parallel size {pp_size}"
        )


def destroy_parallel() -> None:
    """Tears down megatron's groups and the default process group, so a process can initialise again."""
    from megatron.core import parallel_state

    global _control
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _control = None  # destroyed with the default group
    if dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous_store(world_size: int) -> "dist.Store | None":
    """None (torch's env:// rendezvous) under torchrun; an in-memory store for a lone process started without it,
    so tests and single-process tools need no port."""
    if "MASTER_ADDR" in os.environ:
        return None
    if world_size > 1:
        raise ValueError(f"WORLD_SIZE is {world_size} but MASTER_ADDR is unset; launch the trainer with torchrun")
    return dist.HashStore()
