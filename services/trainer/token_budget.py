"""Micro-batches by tokens on GPUs, and their token budget from the free memory (`--use-dynamic-batch-size`,
`--max-tokens-per-gpu`), as verl's dynamic batch size and slime's `--max-tokens-per-gpu` work, chosen when unset.

What a micro-batch of T tokens needs beyond the model and optimizer is its activations, estimated a token at a time
from the model's shape (bf16): per layer the inputs of its norms, projections, attention and MLP that the backward
pass reads (2 bytes x (12 h + 2 q + 4 kv + 5 ffn); 62.7 KB a token a layer was measured for Qwen3-0.6B's shape on an
H200, the estimate gives 71.7), only each layer's input with --recompute-activations (and one layer's whole), and the
output layer's: 8 bytes a word a token for the full logits (bf16 logits, their gradient and the float32 chunks), or
the streamed chunks' 8 bytes x VOCAB_CHUNK with --log-probs-from-hidden. The budget is what fits in 90 % of the free
memory once the optimizer's state (allocated at the first step) is counted, less a GiB for the allocator's slack, the
least over the ranks; with
engines colocated and resident (--no-offload-rollout) the engines grow their cache until 15 % of the GPU is free
(their --mem-fraction-static 0.85), so the activations get at most that.
"""

import logging

import torch
import torch.distributed as dist

from services.common.device_memory import free_and_total

log = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 30
RESIDENT_ENGINES_LEAVE = 0.15  # the share of the GPU a colocated engine keeps free (1 - --mem-fraction-static)


def bytes_per_token(gpt, tp_size: int, recompute: bool, from_hidden: bool, vocab_chunk: int) -> int:
    """The activations a micro-batch keeps for one token on this rank, for the model `gpt` (models.GPTConfig; the
    estimate in the module's docstring; an MoE layer's MLP counted as its top-k experts')."""
    shape = gpt.shape
    h = shape.hidden_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_query_groups * shape.head_dim
    topk = getattr(gpt.transformer, "moe_router_topk", 1) or 1
    ffn = shape.moe_ffn_hidden_size * topk if shape.num_experts else shape.ffn_hidden_size
    layer = 2 * (12 * h + (2 * q + 4 * kv + 5 * ffn) // tp_size)
    kept = 2 * h * shape.num_layers + layer if recompute else layer * shape.num_layers
    output = 8 * vocab_chunk if from_hidden else 8 * shape.padded_vocab_size // tp_size
    return kept + output


def choose(free_bytes: int, pending_bytes: int, per_token: int) -> int:
    """Tokens a micro-batch may hold: 90 % of `free_bytes` less what is still to come (`pending_bytes`) and a
    reserve, a multiple of 256, at least 256."""
    budget = int(0.9 * free_bytes) - pending_bytes - RESERVE_BYTES
    return max(256, budget // per_token // 256 * 256)


def resolve(config, gpt, model: torch.nn.Module, from_hidden: bool, vocab_chunk: int) -> bool:
    """Sets `config.use_dynamic_batch_size` where unset (on: a GPU, one pipeline stage, no --micro-batch-size given)
    and, under it, `config.max_tokens_per_gpu` where unset, which it logs; True where it chose the budget."""
    pipelined = config.parallel.pipeline_model_parallel_size > 1
    if config.use_dynamic_batch_size is None:
        fixed = "micro_batch_size" in config.model_fields_set  # micro-batches of a size the user asked for
        config.use_dynamic_batch_size = torch.cuda.is_available() and not pipelined and not fixed
    if not config.use_dynamic_batch_size or config.max_tokens_per_gpu is not None:
        return False
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pending = 8 * trainable  # AdamW's two float32 moments, made at the first step
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    free, total = free_and_total(device)
    if device.type == "cuda" and config.colocate and not config.offload_rollout:
        free = min(free, int(RESIDENT_ENGINES_LEAVE * total) + pending)
    tp_size = config.parallel.tensor_model_parallel_size
    per_token = bytes_per_token(gpt, tp_size, config.recompute_activations, from_hidden, vocab_chunk)
    config.max_tokens_per_gpu = _least_over_ranks(choose(free, pending, per_token))
    log.info(
        "micro-batches by tokens: --max-tokens-per-gpu %d (%.1f GiB free, about %.0f KiB of activations a token; "
        "pass --max-tokens-per-gpu to choose, or --no-use-dynamic-batch-size)",
        config.max_tokens_per_gpu, free / 2**30, per_token / 1024,
    )  # fmt: skip
    return True


def _least_over_ranks(tokens: int) -> int:
    """The smallest budget any rank chose: the ranks of a tensor- or pipeline-parallel group must cut a step into the
    same micro-batches, and each rank's GPU has its own free memory."""
    if not (dist.is_available() and dist.is_initialized()):
        return tokens
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
