"""The model families the trainer builds, by config.json's `model_type`: one module per family (`base.Family`: its
megatron-core settings and its tensors' HF names), all on megatron-core's own layers, in `registry.FAMILIES`.

The registry is imported on first use (`FAMILIES`, `ALL_RULES`): the families import megatron-core. Which of them
have routed experts (base.MOE's rules) is services/common/model_types.py's MOE_MODEL_TYPES, which the reference engine
reads too."""


def __getattr__(name: str):
    if name in ("FAMILIES", "ALL_RULES", "Family", "Rule"):
        from services.trainer.families import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
