"""Log-probs and entropy of the chosen tokens straight from the last hidden states and the output layer's weight,
streamed over the vocabulary: the logits `[T, V]` never exist, only one `[T, chunk]` float32 block at a time, in the
forward pass and again in the backward pass, which recomputes each block (TRL's `_ChunkedLogProbFunction`, Liger
Kernel's fused linear cross-entropy). What is kept for the backward pass is the hidden states, the tokens and two
floats a token.

Each block's logits are the product in the weight's dtype (as the output layer computes them), then float32: an
online logsumexp gives the normaliser, and an online sum of exp(z) z the expected logit, so that

    log p(token) = z_token - logZ,    entropy = logZ - E_p[z].

With tensor parallelism each rank holds a slice of the vocabulary (`vocab_start`): the maxima, sums and the target
logit are reduced over `group`. The gradient of the hidden states is this rank's part (its slice's), which the
caller's mapping into the tensor-parallel region sums, as Megatron's output layer has it (its input copied into the
region, or gathered from the sequence-parallel one). Columns from `num_valid` on (Megatron's vocabulary padding) take
no probability.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from services.trainer.losses import float_logits


def linear_logprobs_and_entropy(
    hidden_TH: Tensor,
    weight_VH: Tensor,
    tokens_T: Tensor,
    chunk_size: int = 8192,
    vocab_start: int = 0,
    num_valid: int | None = None,
    group=None,
) -> tuple[Tensor, Tensor]:
    """Float32 log p(tokens_T[t]) and the entropy of row t's distribution `[T]` each, where row t's logits are
    `hidden_TH[t] @ weight_VH.T` (this rank's vocabulary columns `[vocab_start, vocab_start + V)` under `group`)."""
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden_TH {tuple(hidden_TH.shape)} and weight_VH {tuple(weight_VH.shape)} must be [T, H], "
                         "[V, H]")  # fmt: skip
    if tokens_T.shape != hidden_TH.shape[:1]:
        raise ValueError(f"tokens_T {tuple(tokens_T.shape)} must be [T] for hidden_TH {tuple(hidden_TH.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    return _LinearLogprobs.apply(hidden_TH, weight_VH, tokens_T, chunk_size, vocab_start, num_valid, group)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, tokens_T, chunk_size, vocab_start, num_valid, group):
        count = hidden_TH.shape[0]
        top_T = hidden_TH.new_full((count,), float("-inf"), dtype=torch.float32)
        total_T, weighted_T, target_T = (hidden_TH.new_zeros(count, dtype=torch.float32) for _ in range(3))
        local_T = tokens_T.long() - vocab_start
        for first, logits_TC in _blocks(hidden_TH, weight_VH, chunk_size, vocab_start, num_valid):
            new_top_T = torch.maximum(top_T, logits_TC.max(-1).values)
            shrink_T = (top_T - new_top_T).exp()
            exp_TC = (logits_TC - new_top_T[:, None]).exp()
            total_T = total_T * shrink_T + exp_TC.sum(-1)
            weighted_T = weighted_T * shrink_T + (exp_TC * logits_TC).sum(-1)
            top_T = new_top_T
            inside_T = (local_T >= first) & (local_T < first + logits_TC.shape[1])
            picked_T = logits_TC.gather(1, (local_T - first).clamp(0, logits_TC.shape[1] - 1)[:, None])[:, 0]
            target_T = torch.where(inside_T, picked_T, target_T)
        if group is not None:  # the ranks' slices of the vocabulary: one normaliser over all of them
            overall_T = top_T.clone()
            dist.all_reduce(overall_T, dist.ReduceOp.MAX, group=group)
            shrink_T = (top_T - overall_T).exp()
            sums = torch.stack([total_T * shrink_T, weighted_T * shrink_T, target_T])
            dist.all_reduce(sums, group=group)
            top_T, (total_T, weighted_T, target_T) = overall_T, sums
        log_z_T = top_T + total_T.log()
        expected_T = weighted_T / total_T
        ctx.save_for_backward(hidden_TH, weight_VH, local_T, log_z_T, expected_T)
        ctx.chunk_size, ctx.vocab_start, ctx.num_valid = chunk_size, vocab_start, num_valid
        return target_T - log_z_T, log_z_T - expected_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        hidden_TH, weight_VH, local_T, log_z_T, expected_T = ctx.saved_tensors
        grad_logprobs_T = _or_zeros(grad_logprobs_T, log_z_T)
        grad_entropy_T = _or_zeros(grad_entropy_T, log_z_T)
        grad_hidden_TH = torch.zeros_like(hidden_TH, dtype=torch.float32)
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        rows_T = torch.arange(len(local_T), device=local_T.device)
        for first, logits_TC in _blocks(hidden_TH, weight_VH, ctx.chunk_size, ctx.vocab_start, ctx.num_valid):
            probs_TC = (logits_TC - log_z_T[:, None]).exp()
            # d log p / dz = onehot - p;  d entropy / dz = -p (z - E_p[z])
            grad_TC = -probs_TC * (
                grad_logprobs_T[:, None] + grad_entropy_T[:, None] * (logits_TC - expected_T[:, None])
            )
            inside_T = (local_T >= first) & (local_T < first + logits_TC.shape[1])
            grad_TC[rows_T[inside_T], local_T[inside_T] - first] += grad_logprobs_T[inside_T]
            block_CH = weight_VH[first : first + logits_TC.shape[1]]
            grad_hidden_TH += grad_TC.to(block_CH.dtype) @ block_CH
            if grad_weight_VH is not None:
                grad_weight_VH[first : first + logits_TC.shape[1]] = grad_TC.T.to(hidden_TH.dtype) @ hidden_TH
        grad_weight_VH = grad_weight_VH.to(weight_VH.dtype) if grad_weight_VH is not None else None
        return grad_hidden_TH.to(hidden_TH.dtype), grad_weight_VH, None, None, None, None, None


def _blocks(hidden_TH: Tensor, weight_VH: Tensor, chunk_size: int, vocab_start: int, num_valid: int | None):
    """(first column, float32 logits [T, chunk]) for each block of the weight's rows, padding columns very negative
    (`losses.float_logits`, given the block's count of real columns)."""
    for first in range(0, weight_VH.shape[0], chunk_size):
        valid = None if num_valid is None else num_valid - vocab_start - first
        yield first, float_logits(hidden_TH @ weight_VH[first : first + chunk_size].T, valid)


def _or_zeros(grad_T: Tensor | None, like_T: Tensor) -> Tensor:
    return torch.zeros_like(like_T) if grad_T is None else grad_T.float()


@contextlib.contextmanager
def hidden_states_out(model):
    """While inside, the Megatron model's output layer returns its input instead of logits (the model then returns
    hidden states `[B, L, H]`), gathered from the sequence-parallel region or copied into the tensor-parallel one as
    the layer would for its own product; yields a list that receives the weight the layer would have used."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer, used = getattr(model, "module", model).output_layer, []

    def forward(hidden, weight=None, runtime_gather_output=None):
        used[:] = [layer.weight if weight is None else weight]
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden), None
        return copy_to_tensor_model_parallel_region(hidden), None

    layer.forward = forward
    try:
        yield used
    finally:
        del layer.forward
