"""LoRA (`--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--target-modules`): low-rank adapters on megatron-core's
linear layers, the base weights frozen. Each targeted layer gets `lora_A` [rank, in] and `lora_B` [out, rank] beside
its `weight` and adds `alpha / rank * B(A(x))` to its output; B starts at 0, so training starts from the base model.

Under tensor parallelism the adapters split as their layer does. A column-parallel layer (QKV, gate+up) splits B by
rows with its output; A sees the whole input, is the same on every rank, and its gradient is summed over the ranks
(each computed it through its rows of B). A row-parallel layer (the attention's output, down) splits A by columns
with its input; the ranks' A(x) are summed before B, which is the same on every rank. Under sequence parallelism the
adapter gathers (column) or scatters (row) the sequence as its layer does, and B of a row-parallel layer has its
gradient summed too. Every rank draws its adapters from the same seed, so a layout does not change the start.

HF's names select what is adapted: `q_proj`, `k_proj`, `v_proj` (megatron's fused `linear_qkv`), `o_proj`
(`linear_proj`), `gate_proj`, `up_proj` (the fused `linear_fc1`), `down_proj` (`linear_fc2`), or `all-linear`. A fused
layer with only some of its parts targeted keeps the other parts' rows of B at 0 (their gradient is masked)."""

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from services.trainer.param_names import global_layer_names, is_adapter

MODULES = {  # HF projection -> (megatron layer, its part of the fused output or None)
    "q_proj": ("linear_qkv", "q"),
    "k_proj": ("linear_qkv", "k"),
    "v_proj": ("linear_qkv", "v"),
    "o_proj": ("linear_proj", None),
    "gate_proj": ("linear_fc1", "gate"),
    "up_proj": ("linear_fc1", "up"),
    "down_proj": ("linear_fc2", None),
    "lm_head": ("output_layer", None),  # not in all-linear (as peft's): name it to adapt the output layer
}
ALL_LINEAR = "all-linear"
SEED = 1234  # the adapters' A: the same on every rank, whatever the layout


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def parts(self) -> dict[str, set[str | None]]:
        """Megatron layer name -> the parts of its output that are adapted."""
        names = set(self.target_modules) - {ALL_LINEAR}
        if ALL_LINEAR in self.target_modules:
            names |= set(MODULES) - {"lm_head"}
        wanted: dict[str, set[str | None]] = {}
        for name in sorted(names):
            layer, part = MODULES[name]
            wanted.setdefault(layer, set()).add(part)
        return wanted


def settings_of(config) -> LoraSettings:
    return LoraSettings(config.lora_rank, config.lora_alpha, config.lora_dropout, tuple(config.target_modules))


def check_targets(target_modules: list[str]) -> None:
    unknown = [t for t in target_modules if t not in MODULES and t != ALL_LINEAR]
    if unknown:
        raise ValueError(
            f"--target-modules {' '.join(unknown)}: not a layer this trainer adapts; use {', '.join(MODULES)} "
            f"or {ALL_LINEAR}"
        )


def apply(model: torch.nn.Module, settings: LoraSettings, shape) -> int:
    """Adds adapters to the targeted layers of `model` (a GPTModel, before its optimizer is built) and freezes
    everything else; returns the number of layers adapted."""
    wanted = settings.parts()
    adapted = 0
    for name, module in model.named_modules():
        layer = name.rsplit(".", 1)[-1]
        if layer not in wanted:
            continue
        if ".experts." in name or ".shared_experts." in name:
            raise ValueError(f"LoRA on MoE experts is not supported yet ({name}): target the attention only")
        if type(module) not in (ColumnParallelLinear, RowParallelLinear):
            raise ValueError(f"{name} is a {type(module).__name__}: LoRA adapts megatron's local linear layers")
        _adapt(module, name, settings, _rows(layer, wanted[layer], module, shape))
        adapted += 1
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    for module in model.modules():
        if type(module) in (ColumnParallelLinear, RowParallelLinear):
            _plain_gradient(module)
    return adapted


def _plain_gradient(module) -> None:
    """megatron's frozen-weight backward multiplies its output's gradient [s, b, out] as it comes, and the logits'
    comes back from a transpose: with b = 1 its strides keep that shape, which torch.matmul will not fold into one
    matrix product, so it runs one product per position, each with the whole weight (0.6 s of a Qwen3-4B step on an
    H200, docs/BENCHMARKS.md). The gradient is given plain strides first, with no copy where none is needed."""
    base = module.forward

    def forward(*args, **kwargs):
        output, bias = base(*args, **kwargs)
        if output.requires_grad:
            output.register_hook(lambda grad: grad.contiguous().view(-1, grad.shape[-1]).view(grad.shape))
        return output, bias

    module.forward = forward


def merged(name: str, module: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of `module`'s weight with its adapter folded in (W + scale * B A): what the engines serve."""
    if not hasattr(module, "lora_A"):
        return module.weight.detach()
    delta = module.lora_B.detach().float() @ module.lora_A.detach().float()
    return (module.weight.detach().float() + module.lora_scale * delta).to(module.weight.dtype)


def _adapt(module, name: str, settings: LoraSettings, rows: torch.Tensor | None) -> None:
    column = isinstance(module, ColumnParallelLinear)
    if column and module.gather_output:
        raise ValueError(f"{name} gathers its output: LoRA adapts layers that keep it split")
    if module.weight is None:
        raise ValueError(f"{name} shares the embedding's weight: lm_head takes an adapter only when it is not tied")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    weight = module.weight
    full_in = module.input_size
    generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    a = torch.empty(settings.rank, full_in)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's start for A
    if not column:  # A splits with the input's columns
        a = a.chunk(tp_size, dim=1)[tp_rank]
    out = module.output_size_per_partition if column else module.output_size
    module.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out, settings.rank, device=weight.device, dtype=weight.dtype))
    if tp_size > 1:  # the gradient-norm code counts a split parameter's shards once each
        split, dim = (module.lora_B, 0) if column else (module.lora_A, 1)
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, dim, 1
    if rows is not None:  # the parts of a fused layer not targeted: their rows of B stay 0
        mask = rows.to(weight.device, weight.dtype)[:, None]
        module.lora_B.register_hook(lambda grad: grad * mask)
    module.lora_scale, module.lora_dropout, module.lora_on = settings.scale, settings.dropout, True
    module.lora_parts = None if rows is None else {"q", "k", "v", "gate", "up"} & _targeted(name, settings)
    base = module.forward

    def forward(input_, *args, **kwargs):
        output, bias = base(input_, *args, **kwargs)
        if not module.lora_on:
            return output, bias
        return output + (_column_delta if column else _row_delta)(module, input_).to(output.dtype), bias

    module.forward = forward


def _column_delta(module, x: torch.Tensor) -> torch.Tensor:
    if module.sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
    else:
        x = copy_to_tensor_model_parallel_region(x)
    x = F.dropout(x, module.lora_dropout, module.training) if module.lora_dropout else x
    h = F.linear(x, copy_to_tensor_model_parallel_region(module.lora_A))
    return F.linear(h, module.lora_B) * module.lora_scale


def _row_delta(module, x: torch.Tensor) -> torch.Tensor:
    x = F.dropout(x, module.lora_dropout, module.training) if module.lora_dropout else x
    h = reduce_from_tensor_model_parallel_region(F.linear(x, module.lora_A))
    if not module.sequence_parallel:
        return F.linear(h, module.lora_B) * module.lora_scale
    delta = F.linear(h, copy_to_tensor_model_parallel_region(module.lora_B)) * module.lora_scale
    return scatter_to_sequence_parallel_region(delta)


def _targeted(name: str, settings: LoraSettings) -> set:
    return settings.parts().get(name.rsplit(".", 1)[-1], set())


def _rows(layer: str, parts: set, module, shape) -> torch.Tensor | None:
    """Which of this rank's output rows of a fused layer are adapted (1) or not (0); None when all are."""
    if None in parts or (layer == "linear_qkv" and parts >= {"q", "k", "v"}) or parts >= {"gate", "up"}:
        return None
    rows = module.output_size_per_partition
    if layer == "linear_fc1":  # this rank's gate rows, then its up rows
        half = torch.zeros(rows // 2)
        return torch.cat([half + ("gate" in parts), half + ("up" in parts)])
    # megatron's QKV: per query group, its query heads, then one key head, then one value head
    groups = shape.num_query_groups // parallel_state.get_tensor_model_parallel_world_size()
    per_group = shape.num_attention_heads // shape.num_query_groups
    head = rows // groups // (per_group + 2)
    group = torch.cat([torch.full((per_group * head,), float("q" in parts)), torch.full((head,), float("k" in parts)),
                       torch.full((head,), float("v" in parts))])  # fmt: skip
    return group.repeat(groups)


@contextlib.contextmanager
def disabled(model: torch.nn.Module):
    """The base model, the adapters switched off: the reference policy of a LoRA run, with no second copy."""
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    for module in adapted:
        module.lora_on = False
    try:
        yield model
    finally:
        for module in adapted:
            module.lora_on = True


def adapter_tensors(model: torch.nn.Module, shape) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters under peft's names for the HF model (`base_model.model.model.layers.0.self_attn
    .q_proj.lora_A.weight`, …), gathered over the tensor-parallel ranks (a collective: each of them calls it). A fused
    layer's A is every part's A; its B is split into the parts' rows as the layer's weight is."""
    from services.trainer.hf_names import gather_tp_param, megatron_to_hf

    group = parallel_state.get_tensor_model_parallel_group()
    global_names = global_layer_names(model)
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        weight = global_names[f"{name}.weight"]
        column = isinstance(module, ColumnParallelLinear)
        a = module.lora_A.detach()
        a = a if column else gather_tp_param(weight, a, group)  # a row layer's A splits as its weight's columns
        b = module.lora_B.detach()
        b = gather_tp_param(weight, b, group) if column else b  # a column layer's B as its weight's rows
        for hf_name, b_part in megatron_to_hf(weight, b, shape):  # the rows of each part (q, k, v; gate, up)
            if column and module.lora_parts is not None and not module.lora_parts & {_part(hf_name)}:
                continue  # a part not targeted: no adapter in the folder
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = a  # the parts of a fused layer share it: a file needs copies
            out[f"{stem}.lora_B.weight"] = b_part
    return out


def load_adapter(model: torch.nn.Module, shape, settings: LoraSettings, folder) -> None:
    """Sets this rank's adapters from a peft adapter folder (`--load` of what --save-hf or a sync wrote, or peft's
    own of the same rank and alpha): adapter_tensors' inverse. The parts of a fused layer (q, k, v; gate, up) must
    share one A, as this trainer's do."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from services.trainer.hf_names import megatron_to_hf, split_tp

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    if int(config["r"]) != settings.rank or float(config.get("lora_alpha", config["r"])) != settings.alpha:
        raise ValueError(
            f"--load {folder}: its adapters have rank {config['r']} and lora_alpha {config.get('lora_alpha')}; "
            f"pass --lora-rank {config['r']} --lora-alpha {config.get('lora_alpha')} to continue them"
        )
    saved = load_file(folder / "adapter_model.safetensors")
    tensors = {key.removeprefix("base_model.model."): value for key, value in saved.items()}
    used: set[str] = set()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    global_names = global_layer_names(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "lora_A"):
                continue
            weight = global_names[f"{name}.weight"]
            column = isinstance(module, ColumnParallelLinear)
            rows = torch.arange(module.output_size)[:, None]  # which full row each HF part's row is
            b, a = torch.zeros(module.output_size, settings.rank), None
            for hf_name, taken in megatron_to_hf(weight, rows, shape):
                stem = hf_name.removesuffix(".weight")
                if f"{stem}.lora_A.weight" not in tensors:
                    continue
                part_a, part_b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
                if a is not None and not torch.equal(a, part_a):
                    raise ValueError(f"--load {folder}: {stem}'s lora_A differs from its fused layer's other parts")
                a = part_a
                b[taken[:, 0]] = part_b.float()
                used |= {f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"}
            if a is None:
                raise ValueError(f"--load {folder} has no adapter for {weight}, which --target-modules adapts")
            module.lora_A.copy_(a if column else split_tp(weight, a, tp_rank, tp_size))
            module.lora_B.copy_(split_tp(weight, b, tp_rank, tp_size) if column else b)
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return  # each stage uses the adapters of its own layers
    if unused := sorted(set(tensors) - used):
        raise ValueError(f"--load {folder} adapts layers --target-modules does not, e.g. {unused[:3]}")


def _part(hf_name: str) -> str:
    return hf_name.rsplit(".", 2)[-2].removesuffix("_proj")


def save_adapter(model: torch.nn.Module, shape, settings: LoraSettings, base: str, out_dir) -> None:
    """Writes a peft adapter folder (adapter_config.json, adapter_model.safetensors) that peft, SGLang and vLLM load
    onto the base model `base`. A collective over the model-parallel ranks of data-parallel replica 0: each stage's
    adapters are gathered to global rank 0, which writes them."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    tensors = adapter_tensors(model, shape)
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, tensors if parallel_state.get_tensor_model_parallel_rank() == 0 else {}, group)
        tensors = {k: v for part in parts for k, v in part.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    save_file(tensors, out_dir / "adapter_model.safetensors")
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(settings, base, tensors), indent=2) + "\n")


def adapter_config(settings: LoraSettings, base: str, tensors) -> dict:
    """peft's adapter_config.json for the adapters named in `tensors` (their modules are its target_modules)."""
    targets = sorted({name.rsplit(".", 3)[-3] for name in tensors})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": settings.rank,
        "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "target_modules": targets, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
        "modules_to_save": None,
    }  # fmt: skip
