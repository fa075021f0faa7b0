"""What a model family is to the trainer: the megatron-core settings its config.json asks for, and where each of its
Megatron tensors comes from in its HF checkpoint (`Rule`s, which `hf_names` applies in both directions)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor within a layer from HF tensors of that layer (`{j}`: an expert's number).

    `dim`: the dimension tensor-parallel ranks split (None: every rank holds all of it). `fuse`: "gate_up" (a gated
    MLP's [gate; up], from two HF tensors or one already fused; each TP rank holds [its gate rows; its up rows]) or
    "qkv" (q, k, v regrouped per query group); None: the HF tensor as it is.
    """

    hf: tuple[str, ...]
    dim: int | None = None
    fuse: str | None = None


def copied(name: str) -> Rule:
    return Rule((name,))


# Llama / Qwen2 / Qwen3: megatron's local-spec names (Transformer Engine fuses the two norms into the next linear).
DENSE = {
    "input_layernorm.weight": copied("input_layernorm.weight"),
    "pre_mlp_layernorm.weight": copied("post_attention_layernorm.weight"),
    "self_attention.linear_qkv.weight": Rule(tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), 0, "qkv"),
    "self_attention.linear_qkv.bias": Rule(tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), 0, "qkv"),
    "self_attention.q_layernorm.weight": copied("self_attn.q_norm.weight"),  # per head: Qwen3, GLM-4.5
    "self_attention.k_layernorm.weight": copied("self_attn.k_norm.weight"),
    "self_attention.linear_proj.weight": Rule(("self_attn.o_proj.weight",), 1),
    "mlp.linear_fc1.weight": Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, "gate_up"),
    "mlp.linear_fc2.weight": Rule(("mlp.down_proj.weight",), 1),
}
# An MoE layer's MLP: the router (and its expert-score correction, a buffer), shared experts split over the tensor-
# parallel ranks like a dense MLP, and routed experts split over the expert-tensor-parallel ranks.
MOE = {
    "mlp.router.weight": copied("mlp.gate.weight"),
    "mlp.router.expert_bias": copied("mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": Rule(
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), 0, "gate_up"
    ),
    "mlp.shared_experts.linear_fc2.weight": Rule(("mlp.shared_experts.down_proj.weight",), 1),
    "mlp.experts.local_experts.{j}.linear_fc1.weight": Rule(
        ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"), 0, "gate_up"
    ),
    "mlp.experts.local_experts.{j}.linear_fc2.weight": Rule(("mlp.experts.{j}.down_proj.weight",), 1),
}


def _no_settings(hf: dict) -> dict:
    return {}


def _full_rotary(hf: dict) -> float:
    return 1.0


def _as_built(target, config) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """A model family: `settings(config.json)` gives the TransformerConfig fields beyond the dense decoder's
    (`models.gpt_config_from_hf`), raising ValueError for what megatron-core cannot express; `rules` name its
    tensors. `rotary_percent`: the share of each head that rope rotates. `gpt_rope`: whether GPTModel's rope
    arguments apply (MLA owns its own). `adapt_spec(layer spec, config)` and `adapt_model(model, config)`: changes to
    megatron's spec (a layer it does not build, another module) and to the built model (each says why)."""

    rules: Mapping[str, Rule]
    settings: Callable[[dict], dict] = _no_settings
    config_class: type = TransformerConfig
    rotary_percent: Callable[[dict], float] = _full_rotary
    gpt_rope: bool = True
    adapt_spec: Callable = _as_built
    adapt_model: Callable = _as_built
    defaults: Mapping = field(default_factory=dict)  # transformers' config defaults that the family's files omit
