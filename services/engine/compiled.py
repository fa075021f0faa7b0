"""torch.compile over the model's decoder (SGLang's `--enable-torch-compile`).

transformers' layers run as written launch about forty kernels a layer (an RMSNorm is seven, rotary embedding ten),
so a small model's decode step is bound by kernel count, not by the bytes it reads. Compiled, each layer's
elementwise work fuses into a few Triton kernels beside its matrix products, and a CUDA graph captures the fused
step (services/engine/graphs.py). Attention stays our own operator (services/engine/attention.py), opaque to the
compiler. Shapes are dynamic: one compilation serves every batch bucket and prefill size (a one-token batch gets one
of its own). The output layer runs as written: it is one matrix product, and its LoRA adapter reads the step's
kept positions.
"""

import torch


def compile_decoder(model: torch.nn.Module) -> None:
    """Replaces the decoder's forward (embeddings, layers, final norm) with its compiled form, in place."""
    decoder = model.get_decoder()
    decoder.forward = torch.compile(decoder.forward, dynamic=True)
