"""torch.compile over the model's decoder (SGLang's `--enable-torch-compile`).

transformers' layers run as written launch about forty kernels a layer (an RMSNorm is seven, rotary embedding ten),
so a small model's decode step is bound by kernel count, not by the bytes it reads. Compiled, each layer's
elementwise work fuses into a few Triton kernels beside its matrix products, and a CUDA graph captures the fused
step (services/engine/graphs.py); so does the step's draw of the next tokens (sampling.pick: a few passes over
the logits instead of seven). Attention stays our own operator (services/engine/attention.py), opaque to the
compiler. The token count is an unbacked size, so that one compilation serves every batch bucket and prefill size,
one token included. The output layer runs as written: it is one matrix product, and its LoRA adapter reads the
step's kept positions. A model the compiler fails on runs as written, with a warning.
"""

import logging

import torch

log = logging.getLogger(__name__)


def compile_decoder(model: torch.nn.Module) -> None:
    """Replaces the decoder's forward (embeddings, layers, final norm) with its compiled form, in place."""
    decoder = model.get_decoder()
    run = _compiled_or_written(decoder.forward, "the model")

    def forward(*args, input_ids=None, position_ids=None, **kwargs):
        input_ids, position_ids = input_ids.clone(), position_ids.clone()  # not views: a view's base is guarded too
        for tensor in (input_ids, position_ids):
            torch._dynamo.decorators.mark_unbacked(tensor, 1)
        return run(*args, input_ids=input_ids, position_ids=position_ids, **kwargs)

    decoder.forward = forward


def compile_pick(pick):
    """`sampling.pick` compiled (the rows a dynamic size: one compilation serves every batch of two rows or more), or
    as written where the compiler fails on it."""
    return _compiled_or_written(pick, "sampling")


def _compiled_or_written(written, what: str):
    """`written` compiled (dynamic shapes); from the compiler's first error on, `written` itself, which is exact."""
    compiled = torch.compile(written, dynamic=True)
    failed = False

    def run(*args, **kwargs):
        nonlocal failed
        if not failed:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # the compiler's errors
                log.warning("%s runs without torch.compile: compiling it failed (%s: %s)", what, type(e).__name__, e)
                failed = True
        return written(*args, **kwargs)

    return run
