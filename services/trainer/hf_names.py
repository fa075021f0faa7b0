"""Weight conversion between HF checkpoints (Llama, Qwen2, Qwen3 dense, Qwen3-MoE) and megatron-core's GPTModel, both
ways.

HF → Megatron yields one tensor-parallel rank's shards; Megatron → HF takes one *full* parameter at a time (what a
TP=1 model would hold; `merge_tp_shards` / `gather_tp_param` build it from the shards) and yields HF tensors. The
weight sync to the rollout engines streams through `megatron_to_hf` too, so every step is a slice, view or concat:
a round trip is bit-identical.

Megatron layouts this module owns:
- `linear_qkv`: rows grouped per query group g as [q heads of g, k_g, v_g]; TP ranks take equal row blocks.
- `linear_fc1` (gated MLP): [gate; up] at TP=1; at TP>1 each rank holds [its slice of gate; its slice of up].
- row-parallel `linear_proj` / `linear_fc2` are split on the input (column) dimension.
- embedding and output layer are padded with zero rows to `padded_vocab_size`, then split on the vocab dimension.
- MoE layers (`num_experts` > 0): `mlp.router.weight` is HF's `mlp.gate.weight`; expert j is
  `mlp.experts.local_experts.{j}.linear_fc1/2.weight` with j numbered across all expert-parallel ranks here (a rank's
  model numbers its own experts from 0), laid out as the dense MLP's and split over the expert-tensor-parallel ranks.
"""

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ModelShape:
    """The facts about a checkpoint that the conversion needs; built from HF config.json by `models.py`."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    num_experts: int = 0  # MoE: routed experts per layer (0: a dense MLP)
    moe_ffn_hidden_size: int = 0


# Layer norms live in their own modules in megatron's local spec and are fused into the next linear in Transformer
# Engine's spec; the two names of each norm are interchangeable.
_NORM_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
}
# Megatron name within a layer → HF name within a layer, for tensors that are copied unchanged.
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_COLUMN_PARALLEL = {
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.weight",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    padding = weight.new_zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, padding])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Works for weights [rows, hidden] and biases [rows] alike: only the leading (output) dimension is regrouped."""
    groups, rest = shape.num_query_groups, q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, rest = shape.num_query_groups, qkv.shape[1:]
    q_rows = shape.num_attention_heads // groups * shape.head_dim
    q, k, v = qkv.reshape(groups, -1, *rest).split([q_rows, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], shape: ModelShape, tp_rank: int = 0, tp_size: int = 1, fused_norms: bool = False,
    ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Yields (megatron name, this rank's shard) for the whole model, layers numbered globally (0..num_layers-1), and
    of the experts those of this expert-parallel rank (numbered globally).

    `hf` may be lazy (tensors read on access). `fused_norms` picks Transformer Engine's names for the layer norms.
    With tied embeddings `output_layer.weight` is yielded too (a pipeline's last stage holds its own copy).
    """

    def shard(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(tp_size, dim=dim)[tp_rank]

    def expert_shard(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(etp_size, dim=dim)[etp_rank]

    embed = _pad_vocab(hf["model.embed_tokens.weight"], shape.padded_vocab_size)
    yield "embedding.word_embeddings.weight", shard(embed)
    head = embed if shape.tie_word_embeddings else _pad_vocab(hf["lm_head.weight"], shape.padded_vocab_size)
    yield "output_layer.weight", shard(head)
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    for layer in range(shape.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_norm, names in _NORM_NAMES.items():  # an MoE layer's MLP norm stays its own module
            fused = fused_norms and not (shape.num_experts and hf_norm == "post_attention_layernorm.weight")
            yield dst + names[fused], hf[src + hf_norm]
        attn = src + "self_attn."
        qkv = [hf[f"{attn}{p}_proj.weight"] for p in "qkv"]
        yield dst + "self_attention.linear_qkv.weight", shard(_fuse_qkv(*qkv, shape))
        if shape.qkv_bias:
            biases = [hf[f"{attn}{p}_proj.bias"] for p in "qkv"]
            yield dst + "self_attention.linear_qkv.bias", shard(_fuse_qkv(*biases, shape))
        if shape.qk_layernorm:
            yield dst + "self_attention.q_layernorm.weight", hf[attn + "q_norm.weight"]
            yield dst + "self_attention.k_layernorm.weight", hf[attn + "k_norm.weight"]
        yield dst + "self_attention.linear_proj.weight", shard(hf[src + "self_attn.o_proj.weight"], dim=1)
        if not shape.num_experts:
            yield dst + "mlp.linear_fc2.weight", shard(hf[src + "mlp.down_proj.weight"], dim=1)
            gate, up = shard(hf[src + "mlp.gate_proj.weight"]), shard(hf[src + "mlp.up_proj.weight"])
            yield dst + "mlp.linear_fc1.weight", torch.cat([gate, up])
            continue
        yield dst + "mlp.router.weight", hf[src + "mlp.gate.weight"]
        local = shape.num_experts // ep_size
        for expert in range(ep_rank * local, (ep_rank + 1) * local):
            hf_expert, megatron_expert = f"{src}mlp.experts.{expert}.", f"{dst}mlp.experts.local_experts.{expert}."
            gate, up = (expert_shard(hf[f"{hf_expert}{p}_proj.weight"]) for p in ("gate", "up"))
            yield megatron_expert + "linear_fc1.weight", torch.cat([gate, up])
            yield megatron_expert + "linear_fc2.weight", expert_shard(hf[hf_expert + "down_proj.weight"], dim=1)


def megatron_to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the HF (name, tensor) pairs held by one full (TP-merged) Megatron parameter with a global layer
    number. The tensors may be views of `tensor`; clone before writing them where storage must not be shared."""
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor[: shape.vocab_size]
        return
    if name == "output_layer.weight":
        if not shape.tie_word_embeddings:
            yield "lm_head.weight", tensor[: shape.vocab_size]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
        return
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    prefix, local = f"model.layers.{match[1]}.", match[2]
    expert = _EXPERT.match(local)
    if local == "mlp.router.weight":
        yield prefix + "mlp.gate.weight", tensor
    elif expert and expert[2] == "linear_fc1":
        gate, up = tensor.chunk(2)
        yield f"{prefix}mlp.experts.{expert[1]}.gate_proj.weight", gate
        yield f"{prefix}mlp.experts.{expert[1]}.up_proj.weight", up
    elif expert:
        yield f"{prefix}mlp.experts.{expert[1]}.down_proj.weight", tensor
    elif local in _REPLICATED:
        yield prefix + _REPLICATED[local], tensor
    elif local in _ROW_PARALLEL:
        yield prefix + _ROW_PARALLEL[local], tensor
    elif local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = local.rsplit(".", 1)[1]
        for proj, part in zip("qkv", _split_qkv(tensor, shape), strict=True):
            yield f"{prefix}self_attn.{proj}_proj.{suffix}", part
    elif local == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        yield prefix + "mlp.gate_proj.weight", gate
        yield prefix + "mlp.up_proj.weight", up
    else:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")


def is_expert(name: str) -> bool:
    """An expert's weight: split over the expert-tensor-parallel ranks rather than the tensor-parallel ones."""
    match = _LAYER.match(name)
    return bool(match and _EXPERT.match(match[2]))


def tp_split_dim(name: str) -> int | None:
    """The dimension a Megatron parameter is split on across (expert-)tensor-parallel ranks; None when replicated."""
    match = _LAYER.match(name)
    local = match[2] if match else name
    expert = _EXPERT.match(local)
    if expert:
        return 0 if expert[2] == "linear_fc1" else 1
    if local in _ROW_PARALLEL:
        return 1
    if local in _COLUMN_PARALLEL:
        return 0
    return None


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full (TP=1) tensor from every tensor-parallel rank's shard of parameter `name`, in rank order."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):  # each shard is [gate slice; up slice]
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def gather_tp_param(name: str, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gathers one parameter's shards over the tensor-parallel group (a collective: every rank calls it) and
    returns the full tensor on every rank."""
    if tp_split_dim(name) is None or dist.get_world_size(group) == 1:
        return shard
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return merge_tp_shards(name, shards)


def hf_names_of(shape: ModelShape) -> list[str]:
    """Every tensor name an HF checkpoint of this shape holds (lm_head only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not shape.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if shape.num_experts:
        per_layer.append("mlp.gate.weight")
        for expert in range(shape.num_experts):
            per_layer += [f"mlp.experts.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")]
    else:
        per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if shape.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if shape.qk_layernorm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names + [f"model.layers.{i}.{n}" for i in range(shape.num_layers) for n in per_layer]
