"""The registry of the trainer's model families, by config.json's `model_type` (services/trainer/families)."""

from services.trainer.families import deepseek_v3, dense, glm4, glm4_moe, qwen3_moe
from services.trainer.families.base import Family, Rule

FAMILIES: dict[str, Family] = {
    "llama": dense.LLAMA,
    "qwen2": dense.QWEN2,
    "qwen3": dense.QWEN3,
    "qwen3_moe": qwen3_moe.FAMILY,
    "glm4": glm4.FAMILY,
    "glm4_moe": glm4_moe.FAMILY,
    "deepseek_v3": deepseek_v3.FAMILY,
}
ALL_RULES: dict[str, Rule] = {name: rule for family in FAMILIES.values() for name, rule in family.rules.items()}
