"""DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3/R1, Kimi K2, Moonlight): multi-latent attention (queries through a low-rank
`q_a`/`q_b` pair, or one `q_proj` without `q_lora_rank`; keys and values from one compressed latent plus a shared
rope key) with yarn rope, the first `first_k_dense_replace` layers dense, then MoE layers with shared experts and
DeepSeek's router, which GLM-4.5 shares (`router_settings`).

Numerics, held against transformers: megatron's MLA de-interleaves the rope channels itself, which is HF's
`rope_interleave=True` (no weight permutation); yarn's frequencies, its cos/sin concentration and the softmax scale
(mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim)) are megatron's `rope_type="yarn"` fields. The router: a sigmoid
per expert, `e_score_correction_bias` added only to choose the experts (megatron's `expert_bias`, a float32 buffer,
held fixed: its aux-loss-free update, `moe_router_bias_update_rate`, is 0 so trainer and engines route alike), the
chosen weights renormalised and scaled by `routed_scaling_factor`, experts picked from the best `topk_group` of
`n_group` groups."""

from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer.transformer_config import MLATransformerConfig

from services.trainer.families.base import DENSE, MOE, Family, Rule, copied


def router_settings(hf: dict, shared_experts: int) -> dict:
    """DeepSeek-V3's router (and GLM-4.5's) as megatron's MoE fields; raises where megatron computes otherwise."""
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if not hf.get("norm_topk_prob", True) and topk > 1:
        raise ValueError("norm_topk_prob=false is not supported: megatron's sigmoid router renormalises the top-k")
    grouped = groups > 1 and group_topk < groups  # every group kept (GLM-4.5's 1 of 1): a plain top-k
    if grouped and topk // group_topk != 2:
        raise ValueError(
            f"n_group {groups} / topk_group {group_topk} with num_experts_per_tok {topk}: HF scores a "
            f"group by its best 2 experts, megatron by its best {topk // group_topk}; only "
            "num_experts_per_tok / topk_group = 2 (DeepSeek-V3's 8 / 4) is the same"
        )
    dense_layers, layers = hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]
    return {
        "num_moe_experts": hf["n_routed_experts"],
        "moe_layer_freq": [0] * dense_layers + [1] * (layers - dense_layers),
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": hf["moe_intermediate_size"] * shared_experts or None,
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": group_topk if grouped else None,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "moe_router_pre_softmax": False,
        "moe_router_dtype": "fp32",  # HF routes in float32 whatever the model's dtype
        "moe_router_load_balancing_type": "none",  # HF's models have none; DeepSeek-V3 balances by the bias
        "moe_aux_loss_coeff": 0.0,
    }


def rope_settings(hf: dict) -> dict:
    """MLA's rope fields (transformers 5 writes `rope_parameters`, 4 `rope_theta` + `rope_scaling`)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":  # mscale_all_dim 0: the softmax scale stays 1/sqrt(q_head_dim)
        return {"rope_type": "rope", "rotary_base": theta, "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported for deepseek_v3 (supported: default, yarn)")
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise ValueError("yarn's attention_factor and truncate=false are not supported (megatron has no such field)")
    factor = params.get("factor") or hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return {
        "rope_type": "yarn",
        "rotary_base": theta,
        "rotary_scaling_factor": float(factor),
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        # HF's cos/sin concentration is mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set, else
        # mscale(f, 1); megatron's the same ratio of its fields, where mscale(f, 0) is 1.
        "mscale": float(mscale) if mscale and mscale_all_dim else 1.0,
        "mscale_all_dim": float(mscale_all_dim or 0.0),
    }


def settings(hf: dict) -> dict:
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for deepseek_v3 (megatron: one switch for every bias)")
    if not hf.get("rope_interleave", True):
        raise ValueError("rope_interleave=false is not supported: megatron's MLA always de-interleaves rope channels")
    return {
        "multi_latent_attention": True,
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_head_dim": hf["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "qk_layernorm": True,  # megatron's MLA spec builds its q_a / kv_a norms only with it
        "rotary_interleaved": False,
        "apply_rope_fusion": False,
        **rope_settings(hf),
        **router_settings(hf, hf.get("n_shared_experts") or 0),
    }


def whole_kv_down_projection(spec, config) -> None:
    """Every tensor-parallel rank computes the whole KV down-projection (as megatron's Transformer Engine spec does).
    Split over the ranks (the local spec's choice), megatron-core 0.16.1 all-gathers its output and passes on the
    rope key's gradient from each rank's own heads only, losing the others'; whole, the rope key crosses megatron's
    sequence-parallel gather, whose backward sums every rank's part."""
    spec.submodules.self_attention.submodules.linear_kv_down_proj = Linear


def mark_kv_down_projection(model, config) -> None:
    """Under sequence parallelism each rank's copy of the KV down-projection sees its part of the sequence: marked,
    its gradient is summed over the tensor-parallel ranks as the layer norms' is."""
    for name, param in model.named_parameters():
        if name.endswith("self_attention.linear_kv_down_proj.weight"):
            param.sequence_parallel = config.sequence_parallel


RULES = {
    **DENSE,
    **MOE,
    "self_attention.linear_q_proj.weight": Rule(("self_attn.q_proj.weight",), 0),  # without q_lora_rank
    "self_attention.linear_q_down_proj.weight": Rule(("self_attn.q_a_proj.weight",), 0),
    "self_attention.q_layernorm.weight": copied("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": Rule(("self_attn.q_b_proj.weight",), 0),
    "self_attention.linear_kv_down_proj.weight": copied("self_attn.kv_a_proj_with_mqa.weight"),  # whole on each rank
    "self_attention.kv_layernorm.weight": copied("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": Rule(("self_attn.kv_b_proj.weight",), 0),
}
FAMILY = Family(
    rules=RULES,
    settings=settings,
    config_class=MLATransformerConfig,
    gpt_rope=False,
    adapt_spec=whole_kv_down_projection,
    adapt_model=mark_kv_down_projection,
)
