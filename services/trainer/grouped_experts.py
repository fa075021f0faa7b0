"""An MoE layer's local experts as two grouped GEMMs through PyTorch's own op (`torch.nn.functional.grouped_mm`), in
place of megatron's `SequentialMLP`, which runs three small GEMMs per expert. megatron's own grouped modules need
Transformer Engine (`TEGroupedMLP`) or the `grouped_gemm` package (`GroupedMLP`); where neither is installed,
`layer_spec` (services/trainer/models.py) builds this one, and slime's `--moe-grouped-gemm` is what it does.

The parameters are `SequentialMLP`'s (`local_experts.<i>.linear_fc1.weight`, `linear_fc2.weight`, the same shapes), so
every boundary that names them is unchanged: the HF names, the weight sync, `--save`/`--load`, the distributed
optimizer, expert parallelism. They are built as views of one [experts, ...] tensor per projection, which a forward
hands the grouped op as it is, with no copy (`Stacked`: autograd splits the gradient back to each expert); where
something moved a weight out of it (a distributed optimizer's buffer, a cast), the forward stacks a copy instead. It
runs all experts' fc1 at once, the activation scaled by the router's probabilities, then all experts' fc2.
Experts split over tensor-parallel ranks compute their shards alike (megatron's expert linears do no communication:
the dispatcher gathers and reduces). Where the op does not apply (biases on the experts, fp8, rows not 16-byte
aligned, a dtype the device's op lacks), `SequentialMLP`'s own forward runs.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class Stacked(torch.autograd.Function):
    """The experts' weights as the one tensor whose views they are; the gradient goes back to each as a view of it."""

    @staticmethod
    def forward(ctx, stacked: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *grad.unbind(0)


class GroupedExperts(SequentialMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stacked: dict[str, torch.Tensor] = {}  # per projection: the tensor every expert's weight is a view of
        for name in ("linear_fc1", "linear_fc2"):
            weights = [getattr(expert, name).weight for expert in self.local_experts]
            stacked = torch.stack([w.detach() for w in weights])
            for weight, view in zip(weights, stacked, strict=True):
                weight.data = view  # the same Parameter (megatron's marks on it stay), its storage the stacked one
            self.stacked[name] = stacked

    def weights(self, name: str) -> torch.Tensor:
        """Every local expert's weight of projection `name`, [experts, out, in]: the stacked tensor they are views of,
        else a stacked copy."""
        weights = [getattr(expert, name).weight for expert in self.local_experts]
        stacked = self.stacked.get(name)
        if stacked is not None and all(w.data_ptr() == v.data_ptr() for w, v in zip(weights, stacked, strict=True)):
            return Stacked.apply(stacked, *weights)
        return torch.stack(weights)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        if not self.grouped(hidden):
            return super().forward(hidden, tokens_per_expert, probs)
        ends = torch.cumsum(tokens_per_expert.to(hidden.device), 0, dtype=torch.int32)
        fc1 = self.weights("linear_fc1")  # [experts, (2 x) ffn, hidden]
        fc2 = self.weights("linear_fc2")  # [experts, hidden, ffn]
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
            # the CPU's op takes float32 too, but not under torch.compile (whose shape check wants bf16)
            and (hidden.dtype == torch.bfloat16 or (hidden.device.type == "cpu" and not torch.compiler.is_compiling()))
        )
