"""Weight conversion between HF checkpoints and megatron-core's GPTModel, both ways, for every family of `families/`
(each names its tensors by `Rule`s: which HF tensors make a Megatron one, how tensor-parallel ranks split it).

HF → Megatron yields one rank's shards; Megatron → HF takes one *full* parameter at a time (what a TP=1 model would
hold; `merge_tp_shards` / `gather_tp_param` build it from the shards) and yields HF tensors. The weight sync to the
rollout engines streams through `megatron_to_hf` too, so every step is a slice, view or concat: a round trip is
bit-identical.

Megatron layouts this module owns:
- `linear_qkv`: rows grouped per query group g as [q heads of g, k_g, v_g]; TP ranks take equal row blocks.
- gated MLPs' `linear_fc1`: [gate; up] at TP=1; at TP>1 each rank holds [its slice of gate; its slice of up].
- row-parallel `linear_proj` / `linear_fc2` are split on the input (column) dimension.
- embedding and output layer are padded with zero rows to `padded_vocab_size`, then split on the vocab dimension.
- MoE layers: expert j is `mlp.experts.local_experts.{j}.…` with j numbered across all expert-parallel ranks here (a
  rank's model numbers its own experts from 0), split over the expert-tensor-parallel ranks.
"""

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the families import megatron-core: loaded with the model, not with this module
    from services.trainer.families.base import Rule


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
    rules: Mapping[str, "Rule"] = field(default_factory=dict, compare=False)  # the family's tensor names


# Transformer Engine's spec fuses a layer's norms into the next linear: its names for the local spec's norms.
_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GLOBAL_SPLIT = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0}


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
    """q, k and v as views [groups, rows of each group, *rest] of `qkv`: each flattens to its HF tensor."""
    groups = shape.num_query_groups
    q_rows = shape.num_attention_heads // groups * shape.head_dim
    return qkv.unflatten(0, (groups, -1)).split([q_rows, shape.head_dim, shape.head_dim], dim=1)


def _template(local: str) -> tuple[str, str | None]:
    """A layer-local Megatron name as its rule's key (`{j}` for the expert number) and the expert number."""
    expert = _EXPERT.match(local)
    return (f"mlp.experts.local_experts.{{j}}.{expert[2]}", expert[1]) if expert else (local, None)


def _shard(rule: "Rule", tensors: list[torch.Tensor], shape: ModelShape, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the Megatron tensor that `rule` makes of the HF `tensors`."""

    def split(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if rule.dim is None else tensor.chunk(size, dim=rule.dim)[rank]

    if rule.fuse == "qkv":
        return split(_fuse_qkv(*tensors, shape))
    if rule.fuse == "gate_up":
        gate, up = tensors if len(tensors) == 2 else tensors[0].chunk(2)
        return torch.cat([split(gate), split(up)])
    return split(tensors[0])


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    fused_norms: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (megatron name, this rank's shard) for the whole model, layers numbered globally (0..num_layers-1), and
    of the experts those of this expert-parallel rank (numbered globally). A layer's tensors are those of the
    family's rules whose HF tensors the checkpoint holds (dense or MoE layer, with or without biases, ...).

    `hf` may be lazy (tensors read on access). `fused_norms` picks Transformer Engine's names for the layer norms.
    With tied embeddings `output_layer.weight` is yielded too (a pipeline's last stage holds its own copy).
    """
    embed = _pad_vocab(hf["model.embed_tokens.weight"], shape.padded_vocab_size)
    yield "embedding.word_embeddings.weight", embed.chunk(tp_size)[tp_rank]
    head = embed if shape.tie_word_embeddings else _pad_vocab(hf["lm_head.weight"], shape.padded_vocab_size)
    yield "output_layer.weight", head.chunk(tp_size)[tp_rank]
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    local_experts = shape.num_experts // ep_size
    for layer in range(shape.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        moe_layer = f"{src}mlp.gate.weight" in hf
        for name, rule in shape.rules.items():
            experts = range(ep_rank * local_experts, (ep_rank + 1) * local_experts) if "{j}" in name else [None]
            for j in experts:
                sources = [src + part.format(j=j) for part in rule.hf]
                if not all(source in hf for source in sources):
                    continue
                rank, size = (etp_rank, etp_size) if j is not None else (tp_rank, tp_size)
                local = name.format(j=j)
                if fused_norms and local in _FUSED_NORMS and not (moe_layer and local == "pre_mlp_layernorm.weight"):
                    local = _FUSED_NORMS[local]  # an MoE layer's MLP norm stays its own module
                yield dst + local, _shard(rule, [hf[s] for s in sources], shape, rank, size)


def megatron_to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the HF (name, tensor) pairs held by one full (TP-merged) Megatron tensor with a global layer number.
    The tensors may be views of `tensor`; clone before writing them where storage must not be shared."""
    for hf_name, view, hf_shape in megatron_to_hf_views(name, tensor, shape):
        yield hf_name, view.reshape(hf_shape)


def megatron_to_hf_views(
    name: str, tensor: torch.Tensor, shape: ModelShape
) -> Iterator[tuple[str, torch.Tensor, torch.Size]]:
    """`megatron_to_hf` without a copy: (HF name, a view of `tensor`, the HF shape), the view's elements in the HF
    tensor's order (q, k and v of a fused `linear_qkv` keep a group dimension that `reshape` folds)."""
    if name == "embedding.word_embeddings.weight":
        yield _same("model.embed_tokens.weight", tensor[: shape.vocab_size])
        return
    if name == "output_layer.weight":
        if not shape.tie_word_embeddings:
            yield _same("lm_head.weight", tensor[: shape.vocab_size])
        return
    if name == "decoder.final_layernorm.weight":
        yield _same("model.norm.weight", tensor)
        return
    match = _LAYER.match(name)
    local = {fused: plain for plain, fused in _FUSED_NORMS.items()}.get(match[2], match[2]) if match else ""
    template, expert = _template(local)
    rule = shape.rules.get(template)
    if rule is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    hf_names = [f"model.layers.{match[1]}.{part.format(j=expert)}" for part in rule.hf]
    if rule.fuse == "qkv":
        for hf_name, part in zip(hf_names, _split_qkv(tensor, shape), strict=True):
            yield hf_name, part, torch.Size((part.shape[0] * part.shape[1], *part.shape[2:]))
    elif rule.fuse == "gate_up" and len(hf_names) == 2:
        yield from (_same(*pair) for pair in zip(hf_names, tensor.chunk(2), strict=True))
    else:
        yield _same(hf_names[0], tensor)


def _same(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor, torch.Size]:
    return name, tensor, tensor.shape


def is_expert(name: str) -> bool:
    """A routed expert's weight: split over the expert-tensor-parallel ranks rather than the tensor-parallel ones."""
    match = _LAYER.match(name)
    return bool(match and _EXPERT.match(match[2]))


def tp_split_dim(name: str) -> int | None:
    """The dimension a Megatron parameter is split on across (expert-)tensor-parallel ranks; None when replicated."""
    if name in _GLOBAL_SPLIT:
        return _GLOBAL_SPLIT[name]
    from services.trainer.families import ALL_RULES

    match = _LAYER.match(name)
    rule = ALL_RULES.get(_template(match[2] if match else name)[0])
    return rule.dim if rule else None


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full (TP=1) tensor from every tensor-parallel rank's shard of parameter `name`, in rank order."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):  # each shard is [gate slice; up slice]
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def split_tp(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard of the full tensor of parameter `name` (merge_tp_shards' inverse)."""
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=dim)[rank]


def gather_tp_param(name: str, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gathers one parameter's shards over the tensor-parallel group (a collective: every rank calls it) and
    returns the full tensor on every rank."""
    if tp_split_dim(name) is None or dist.get_world_size(group) == 1:
        return shard
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return merge_tp_shards(name, shards)
