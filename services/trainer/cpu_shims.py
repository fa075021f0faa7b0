"""Every shim that lets megatron-core 0.16.1 build and run a GPTModel on a machine without CUDA, in one place.

The trainer runs the same Megatron code on the 2-core CPU test machines as on GPUs; megatron-core assumes CUDA in a
few spots, and this module is the only place that papers over them. On a CUDA machine every function here is a no-op.
The pipeline schedules are shimmed narrowly (their token counter is allocated with `device="cuda"`), and so is the
distributed optimizer (`--use-distributed-optimizer`): megatron's optimizer allocates its flags with `device="cuda"` and
sorts parameters into fp32 / fp16 / bf16 by their CUDA type names.
"""

import functools

import torch

_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _current_device_cpu() -> str:
    # Megatron allocates its buffers with `device=torch.cuda.current_device()`; answering "cpu" puts them in RAM.
    return "cpu"


def apply_cpu_shims() -> None:
    """Patches `torch.cuda.current_device` to return "cpu" when CUDA is absent, makes megatron's activation
    recompute keep no CUDA RNG state (there is none; the CPU state it also keeps is the one that matters), the
    pipeline schedules allocate their token counter on the CPU, and megatron's optimizer runs there (see
    `_optimizer_on_cpu`). Idempotent; no-op on CUDA."""
    global _applied
    if _applied or cuda_available():
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = _current_device_cpu
    _moe_all_to_all_on_cpu()
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: None
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    schedules.torch = _TorchOnCpu()
    _optimizer_on_cpu()
    _tied_embeddings_on_cpu()
    _applied = True


def _tied_embeddings_on_cpu() -> None:
    """With tied embeddings and pipeline stages, megatron gives the last stage its copy of the embedding by an
    all-reduce over the first and last stages, after moving it with `.cuda()`: on the CPU the copy stays where it is."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(setup)
    def setup_on_cpu(self) -> None:
        cuda, torch.Tensor.cuda = torch.Tensor.cuda, lambda tensor, *args, **kwargs: tensor
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def _optimizer_on_cpu() -> None:
    """megatron's DistributedOptimizer on the CPU: its modules (and the norm helper of megatron's utils, which clipping
    calls) allocate their flags and norms with `device="cuda"`, which land on the CPU; and its constructor and its
    gradient clipping tell fp32 from fp16 / bf16 parameters by CUDA type names (`torch.cuda.FloatTensor`), which CPU
    tensors give while those run."""
    import megatron.core.utils as megatron_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer

    for module in (megatron_optimizer, clip_grads, megatron_utils):
        module.torch = _TorchOnCpu()
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = megatron_optimizer.clip_grad_by_total_norm_fp32 = clip


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not self.is_cuda:
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def _with_cuda_type_names(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            return function(*args, **kwargs)
        finally:
            torch.Tensor.type = _tensor_type

    return run


def apply_missing_te_shims() -> None:
    """Where Transformer Engine is not installed, CPU or GPU: megatron-core 0.16.1's MoE router names
    `te_general_gemm` (its import failed, so the name is undefined): defined as None, the router takes its own torch.mm
    path. Multi-latent attention imports TE's stand-ins (mocks, not classes), believes TE present and fails on
    `isinstance(linear_proj, TELinear)`, a check for an FP8 memory saving only: told the truth, it skips it."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def _moe_all_to_all_on_cpu() -> None:
    """MoE's all-to-all token dispatcher (tokens travel to their experts' ranks in splits of any size) copies its split
    sizes to the host on a side CUDA stream; on the CPU they are there already, and become the numpy arrays that path
    makes. (The all-gather dispatcher needs no shim but the same token count on every expert-parallel rank.)"""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def splits_on_host(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                if torch.is_tensor(value := getattr(self, name, None)):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on the CPU"  # __init__ makes one when None
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = splits_on_host


class _TorchOnCpu:
    """`torch` as a megatron module sees it: `torch.zeros(..., device="cuda")` and `torch.tensor(...,
    device="cuda")` land on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.tensor(*args, **kwargs)


def seed_model_parallel_rng(seed: int) -> None:
    """Seeds megatron's tensor-parallel RNG tracker.

    On CPU the tracker is the inference one: the training tracker snapshots and restores CUDA RNG states
    (`torch.cuda.get_rng_state`), which do not exist without CUDA. Its `fork()` is then a no-op, so dropout inside
    tensor-parallel regions is not decorrelated across ranks on CPU; the supported models use no dropout.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not cuda_available(), force_reset_rng=True
    )
