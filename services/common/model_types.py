"""Which HF model types (config.json's `model_type`) have routed experts: the trainer builds these families with
MoE layers and the reference engine captures their routers' choices, so the fact lives here, below both."""

MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "deepseek_v3")
