"""The reference engine's parameters by the names of the checkpoint on disk, as SGLang's models load them: the weight
sync sends those names. Where transformers keeps a family's tensors fused, a name maps to a view of the fused one:
the MoE families' experts (Qwen3-MoE, GLM-4.5, DeepSeek-V3) `mlp.experts.{j}.{gate,up,down}_proj.weight` are slices
of `mlp.experts.gate_up_proj` ([experts, gate rows then up rows, hidden]) and `mlp.experts.down_proj`."""

import re

import torch

_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<j>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors that a checkpoint holds: its parameters and persistent buffers (DeepSeek-V3's and GLM-4.5's
    `e_score_correction_bias`), by their names in memory."""
    return model.state_dict(keep_vars=True)


def parameter_view(parameters: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor (a parameter, or a view into one) that the checkpoint's `name` is; None when the model has none."""
    if name in parameters:
        return parameters[name]
    match = _EXPERT.match(name)
    if match is None:
        return None
    experts, expert, proj = match["experts"], int(match["j"]), match["proj"]
    fused = parameters.get(f"{experts}.down_proj" if proj == "down" else f"{experts}.gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        return None
    if proj == "down":
        return fused[expert]
    gate, up = fused[expert].chunk(2)
    return gate if proj == "gate" else up
