"""Llama, Qwen2 (biases on q, k and v) and Qwen3 (per-head QK layer norms): megatron's dense GPT layer as it is."""

from services.trainer.families.base import DENSE, Family


def _no_attention_bias(model_type: str):
    def settings(hf: dict) -> dict:
        # Megatron has one switch for every linear bias; this would put a bias on o_proj too.
        if hf.get("attention_bias"):
            raise ValueError(f"attention_bias=true is not supported for {model_type}")
        return {"qk_layernorm": model_type == "qwen3"}

    return settings


LLAMA = Family(rules=DENSE, settings=_no_attention_bias("llama"))
QWEN2 = Family(rules=DENSE, settings=lambda hf: {"add_qkv_bias": True})
QWEN3 = Family(rules=DENSE, settings=_no_attention_bias("qwen3"))
