"""Imports megatron-core with its fused functions compiled on their first call.

megatron-core wraps its fused functions (bias-GeLU, SwiGLU, RoPE...) in `torch.compile` as it is imported, and
`torch.compile` imports torch's compiler (TorchDynamo, Inductor) to make each wrapper: half of the 6 s of CPU that
importing megatron costs every trainer process, for functions that many runs never call (the CPU path calls none).
Imported here first, those wrappers call `torch.compile` when first called instead, and run the same from then on."""

import functools
import sys

import torch


def import_megatron() -> None:
    """Imports megatron.core (once per process) with its `jit_fuser` compiling on first call."""
    if "megatron.core" in sys.modules:
        return
    compile_now = torch.compile
    torch.compile = functools.partial(_on_first_call, compile_now)
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit keeps the wrapper as its jit_fuser)
    finally:
        torch.compile = compile_now


def _on_first_call(compile_now, function=None, **options):
    if function is None:  # @torch.compile(**options)
        return functools.partial(_on_first_call, compile_now, **options)
    compiled = None

    @functools.wraps(function)
    def run(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = compile_now(function, **options)
        return compiled(*args, **kwargs)

    return run
