"""Routed-experts capture, SGLang's `--enable-return-routed-experts`: forward hooks on each MoE layer's router record
the top-k expert ids the model used, so that a finished request can return them (rollout routing replay, R3)."""

import base64
import contextlib

import numpy as np
import torch

from services.common.errors import StartupError
from services.common.model_types import MOE_MODEL_TYPES

# transformers' routers of the MoE families return (router_logits, top-k weights, top-k expert ids); the experts are
# run on exactly those ids, so they are what the hooks record.
TOPK_IDS_OUTPUT = 2


class RoutingCapture:
    """Records, during the forward passes it is `active` for, every MoE layer's top-k expert ids."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        if config.model_type not in MOE_MODEL_TYPES:
            raise StartupError(
                f"--enable-return-routed-experts needs an MoE model ({', '.join(MOE_MODEL_TYPES)}), but this one is "
                f"{config.model_type!r}, which has no routed experts; drop the flag"
            )
        self.num_layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.captured: dict[int, torch.Tensor] = {}
        self.active = False
        routers = {i: getattr(layer.mlp, "gate", None) for i, layer in enumerate(model.model.layers)}
        routers = {i: r for i, r in routers.items() if hasattr(r, "top_k")}  # dense layers' MLPs have no router
        if not routers:
            raise StartupError(
                f"--enable-return-routed-experts found no MoE router (layers[i].mlp.gate) in this "
                f"{config.model_type} model; drop the flag"
            )
        for layer_id, router in routers.items():
            router.register_forward_hook(self._hook(layer_id))

    def _hook(self, layer_id: int):
        def record(module, args, output) -> None:
            if self.active:
                self.captured[layer_id] = output[TOPK_IDS_OUTPUT]

        return record

    @contextlib.contextmanager
    def forward(self, shape: tuple[int, int], enabled: bool):
        """Around one forward pass over `shape` = [rows, positions] tokens: yields a list that afterwards holds the
        routing [rows, positions, num_layers, top_k] (int32, CPU; dense layers 0), or stays empty if not enabled."""
        result: list[torch.Tensor] = []
        self.active, self.captured = enabled, {}
        try:
            yield result
        finally:
            self.active = False
        if enabled:
            rows = torch.zeros(*shape, self.num_layers, self.top_k, dtype=torch.int32)
            layer_ids = list(self.captured)
            if layer_ids:  # one copy off the device for all layers
                ids = torch.stack([self.captured[i] for i in layer_ids], 1)  # [tokens, MoE layers, top_k]
                rows[:, :, layer_ids] = ids.view(*shape, len(layer_ids), self.top_k).to("cpu", torch.int32)
            self.captured = {}
            result.append(rows)


def check_start_len(start_len, prompt_len: int) -> int:
    """`routed_experts_start_len`, checked as SGLang does: rows are returned from this prompt position on."""
    if isinstance(start_len, bool) or not isinstance(start_len, int):
        raise ValueError(f"routed_experts_start_len must be an integer, got {start_len!r}")
    if start_len < 0:
        raise ValueError(
            f"routed_experts_start_len={start_len} is lower than 0. Please use a non-negative routed_experts_start_len."
        )
    if start_len > prompt_len:
        raise ValueError(
            f"routed_experts_start_len={start_len} is higher than the number of input tokens "
            f"({prompt_len}). Please use a smaller routed_experts_start_len."
        )
    return start_len


def encode(chunks: list[torch.Tensor], start_len: int, num_tokens: int) -> str:
    """SGLang's meta_info["routed_experts"]: base64 of the int32 (little-endian, C order) array
    [num_tokens - 1 - start_len, num_layers, top_k]; the last token never went through the model."""
    rows = torch.cat(chunks)[start_len : num_tokens - 1]
    return base64.b64encode(np.ascontiguousarray(rows.numpy(), dtype="<i4").tobytes()).decode()
