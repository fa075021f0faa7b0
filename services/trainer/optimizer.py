"""AdamW with Megatron's learning-rate schedule (linear warmup, then constant or cosine decay to --min-lr) and
gradient clipping whose norm counts every parameter once across tensor-parallel ranks."""

import math

import torch
import torch.distributed as dist


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float):
    """AdamW; norms and biases take no weight decay (as Megatron does). Parameters in bf16/fp16 get float32 master
    weights (`MasterAdamW`): an update of lr 1e-6 is far below bf16's resolution and would be lost."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay) or None  # one kernel for all parameters instead of one per tensor
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in decay + no_decay):
        return MasterAdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def _master(param: torch.Tensor) -> torch.Tensor:
    """A parameter's float32 master: the checkpoint's float32 value where the loader kept one (models.load_hf_weights:
    between the grid points of bf16, so that small updates move the bf16 weight as often as they add up to a step of
    it, as float32 weights cast to bf16 do), else the parameter's own value."""
    value = getattr(param, "checkpoint_value", None)
    if value is None:
        return param.detach().float().clone()
    del param.checkpoint_value
    return value.detach().float().clone()


class MasterAdamW(torch.optim.AdamW):
    """AdamW on float32 copies of low-precision parameters: gradients are copied up before the step and the updated
    weights copied down after it. The masters are part of the state dict, so a resume continues exactly."""

    def __init__(self, groups: list[dict], **settings):
        self.model_params = [p for g in groups for p in g["params"]]
        masters = [{**g, "params": [_master(p) for p in g["params"]]} for g in groups]
        super().__init__(masters, **settings)
        self.masters = [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for param, master in zip(self.model_params, self.masters, strict=True):
            grad = gradient(param)  # float32 already where megatron's DDP adds it up so: `.float()` is then itself
            master.grad = None if grad is None else grad.float()
        super().step()
        torch._foreach_copy_(self.model_params, self.masters)  # a few kernels for all, not one a parameter

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """The masters take the model's weights again (after weights were loaded into the model: megatron's name)."""
        for param, master in zip(self.model_params, self.masters, strict=True):
            master.copy_(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        for master, param, saved in zip(self.masters, self.model_params, state.pop("masters"), strict=True):
            master.copy_(saved)
            param.copy_(saved)
        super().load_state_dict(state)


def lr_factor(step: int, warmup: int, decay_steps: int | None, style: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant" or not decay_steps:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    if style == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if style == "linear":
        return 1 - (1 - min_ratio) * progress
    raise ValueError(f"lr_decay_style must be constant, linear or cosine, got {style!r}")


def build_scheduler(optimizer, warmup: int, decay_steps: int | None, style: str, lr: float, min_lr: float):
    lr_factor(0, warmup, decay_steps, style, 0.0)  # checks the style now rather than at the first step
    ratio = min_lr / lr if lr else 0.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, decay_steps, style, ratio))


def gradient(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient for the step: `.grad`, else the float32 `main_grad` megatron's DDP adds a bf16
    parameter's gradients up in (torch allows no float32 `.grad` on a bf16 tensor)."""
    return param.grad if param.grad is not None else getattr(param, "main_grad", None)


def clip_gradients(
    model: torch.nn.Module, max_norm: float, tp_group=None, tp_rank: int = 0, expert_group=None
) -> float:
    """Clips gradients to `max_norm` (0: no clipping) and returns the global norm. A tensor-parallel shard counts on
    every rank, a replicated parameter (norms) only on TP rank 0, and the squares are summed over the TP group; an
    MoE expert's over `expert_group` (expert-tensor x expert-parallel ranks), each of which holds other experts. A
    tied embedding's copy on the last pipeline stage (megatron marks it `shared`) counts once, on the first."""
    from services.trainer.hf_names import is_expert

    counted, grads = {False: [], True: []}, []
    for name, param in model.named_parameters():
        grad = gradient(param)
        if grad is None:
            continue
        grads.append(grad)
        if getattr(param, "shared", False):
            continue
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0 or is_expert(name):
            counted[is_expert(name)].append(grad)
    device = grads[0].device if grads else torch.device("cpu")
    squares = {experts: _sum_of_squares(tensors, device) for experts, tensors in counted.items()}
    for experts, group in ((False, tp_group), (True, expert_group)):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(squares[experts], group=group)
    norm = float((squares[False] + squares[True]).sqrt())  # the step's one wait for the device
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of every element's square over `tensors`, in float32 on `device`: a few kernels for all of them."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()
