"""An MoE layer's local experts as two grouped GEMMs through PyTorch's own op (`torch.nn.functional.grouped_mm`), in
place of megatron's `SequentialMLP`, which runs three small GEMMs per expert. megatron's own grouped modules need
Transformer Engine (`TEGroupedMLP`) or the `grouped_gemm` package (`GroupedMLP`); where neither is installed,
`layer_spec` (services/trainer/models.py) builds this one, and slime's `--moe-grouped-gemm` is what it does.

The parameters are `SequentialMLP`'s (`local_experts.<i>.linear_fc1.weight`, `linear_fc2.weight`, the same shapes), so
every boundary that names them is unchanged: the HF names, the weight sync, `--save`/`--load`, the distributed
optimizer, expert parallelism. A forward stacks them (autograd splits the gradients back) and runs all experts' fc1
at once, the activation scaled by the router's probabilities, then all experts' fc2. Experts split over
tensor-parallel ranks compute their shards alike (megatron's expert linears do no communication: the dispatcher
gathers and reduces). Where the op does not apply (biases on the experts, fp8, rows not 16-byte aligned, a dtype the
device's op lacks), `SequentialMLP`'s own forward runs.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class GroupedExperts(SequentialMLP):
    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        if not self.grouped(hidden):
            return super().forward(hidden, tokens_per_expert, probs)
        ends = torch.cumsum(tokens_per_expert.to(hidden.device), 0, dtype=torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])  # [experts, (2 x) ffn, hidden]
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])  # [experts, hidden, ffn]
        intermediate = self.activation(grouped_mm(hidden, fc1.transpose(1, 2), offs=ends))
        scaled = (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)
        return grouped_mm(scaled, fc2.transpose(1, 2), offs=ends), None

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The expert MLP's activation, as megatron's MLP computes it unfused."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(x)
        gate, linear = torch.chunk(x, 2, dim=-1)
        if c.activation_func_clamp_value is not None:
            gate = gate.clamp(max=c.activation_func_clamp_value)
            linear = linear.clamp(min=-c.activation_func_clamp_value, max=c.activation_func_clamp_value)
        return c.activation_func(gate) * (linear + c.glu_linear_offset)

    def grouped(self, hidden: torch.Tensor) -> bool:
        """Whether the grouped op computes what SequentialMLP would, here."""
        c = self.config
        first = self.local_experts[0]
        dims = (*first.linear_fc1.weight.shape, *first.linear_fc2.weight.shape)
        aligned = all(dim * hidden.element_size() % 16 == 0 for dim in dims)
        return (
            grouped_mm is not None
            and self.num_local_experts > 1
            and not (c.add_bias_linear or c.fp8 or c.fp4 or c.moe_apply_probs_on_input)
            and aligned
            and (hidden.device.type == "cpu" or hidden.dtype == torch.bfloat16)
        )
