"""The model families the trainer builds, by config.json's `model_type`: one module per family (`base.Family`: its
megatron-core settings and its tensors' HF names), all on megatron-core's own layers, in `registry.FAMILIES`.

The registry is imported on first use (`FAMILIES`, `ALL_RULES`), so that which families have routed experts is read
here without megatron-core: the reference engine's routing capture hooks the routers of those families."""

MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "deepseek_v3")  # the families built with base.MOE's rules


def __getattr__(name: str):
    if name in ("FAMILIES", "ALL_RULES", "Family", "Rule"):
        from services.trainer.families import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
