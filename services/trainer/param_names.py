"""The names of a model's tensors that models.py and lora.py both map to an HF checkpoint's: which tensors a
checkpoint holds (not LoRA's adapters), and each one's name with its layer and expert numbered across every pipeline
stage and expert-parallel rank."""

import torch
from megatron.core import parallel_state


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint holds: the parameters (not LoRA's adapters), and the routers' expert-score
    corrections (DeepSeek-V3's `e_score_correction_bias`, megatron's `expert_bias` buffer)."""
    buffers = {name: buffer for name, buffer in model.named_buffers() if name.endswith("router.expert_bias")}
    return {name: p for name, p in model.named_parameters() if not is_adapter(name)} | buffers


def global_layer_names(model: torch.nn.Module) -> dict[str, str]:
    """Model parameter name → the same name with the layer numbered across all pipeline stages and the expert across
    all expert-parallel ranks."""
    names = {}
    layers = model.decoder.layers
    first_expert = parallel_state.get_expert_model_parallel_rank() * (model.config.num_moe_experts or 0)
    first_expert //= parallel_state.get_expert_model_parallel_world_size()
    for name in checkpoint_tensors(model):
        global_name = name
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers.") :].split(".", 1)
            if rest.startswith("mlp.experts.local_experts."):
                expert, weight = rest[len("mlp.experts.local_experts.") :].split(".", 1)
                rest = f"mlp.experts.local_experts.{first_expert + int(expert)}.{weight}"
            global_name = f"decoder.layers.{layers[int(local)].layer_number - 1}.{rest}"
        names[name] = global_name
    return names
