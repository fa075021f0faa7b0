"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK layer norm, no biases) with routed
experts in place of every dense MLP. The router is a softmax over all experts and their top-k, renormalised over the
k when `norm_topk_prob` (Megatron: a softmax over the top-k logits, the same numbers); no shared expert; the
load-balancing loss is the auxiliary loss with `router_aux_loss_coef`."""

from services.trainer.families.base import DENSE, MOE, Family

HF_DEFAULTS = {"norm_topk_prob": False, "router_aux_loss_coef": 0.001}  # transformers' Qwen3MoeConfig


def settings(hf: dict) -> dict:
    """megatron-core's settings (TransformerConfig fields) for a Qwen3-MoE config.json."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"Qwen3-MoE with dense layers (mlp_only_layers {hf.get('mlp_only_layers')}, decoder_sparse_step "
            f"{hf.get('decoder_sparse_step')}) is not supported; every released Qwen3-MoE has experts in every layer"
        )
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for qwen3_moe")
    hf = {**HF_DEFAULTS, **hf}
    return {
        "qk_layernorm": True,
        "num_moe_experts": hf.get("num_experts") or hf["num_local_experts"],  # the released files / transformers 5
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_pre_softmax": not hf["norm_topk_prob"],
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf["router_aux_loss_coef"]),
    }


FAMILY = Family(rules={**DENSE, **MOE}, settings=settings)
