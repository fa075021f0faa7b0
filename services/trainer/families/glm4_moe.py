"""GLM-4.5 MoE (`glm4_moe`: GLM-4.5, 4.6, 4.7): GLM-4's attention (q, k, v biases; rope on the first half of each
head, here with the two halves rotated together, megatron's default; optional per-head QK norms, `use_qk_norm`)
without the sandwich norms, the first `first_k_dense_replace` layers dense, then MoE layers with shared experts behind
DeepSeek-V3's sigmoid router (`deepseek_v3.router_settings`)."""

from services.trainer.families.base import DENSE, MOE, Family
from services.trainer.families.deepseek_v3 import router_settings
from services.trainer.families.glm4 import partial_rotary_factor


def settings(hf: dict) -> dict:
    return {
        "add_qkv_bias": bool(hf.get("attention_bias", False)),
        "qk_layernorm": bool(hf.get("use_qk_norm", False)),
        **router_settings(hf, hf.get("n_shared_experts") or 0),
    }


FAMILY = Family(rules={**DENSE, **MOE}, settings=settings, rotary_percent=partial_rotary_factor)
