"""Model families beyond the dense Llama / Qwen2 / Qwen3 that `models.py` builds: one module per family, each turning
its config.json into megatron-core's settings for the layers it adds (`moe_settings`)."""

from services.trainer.families import qwen3_moe

MOE_FAMILIES = {"qwen3_moe": qwen3_moe}
