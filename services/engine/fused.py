"""Fewer kernels a decode step: transformers' RMSNorm of the supported families (seven elementwise kernels each, four
norms a layer in Qwen3) runs as torch's one `rms_norm` op. A small model's decode step is bound by its kernel count,
and this is where its layers spend the most kernels on the least work."""

import torch
import torch.nn.functional as F

# The families' norms that are x / rms(x) * weight, computed in float32 (transformers' LlamaRMSNorm and its copies).
NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Glm4RMSNorm", "Glm4MoeRMSNorm",
         "DeepseekV3RMSNorm"}  # fmt: skip


def _rms_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(hidden.dtype)


def fuse_norms(model: torch.nn.Module) -> int:
    """Rebinds each known RMSNorm's forward to `_rms_norm`; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in NORMS:
            module.forward = _rms_norm.__get__(module)
            count += 1
    return count
