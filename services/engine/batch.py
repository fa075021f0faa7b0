"""Continuous batching over one HF model: every running sequence is a row of one batched KV cache.

A new sequence is prefilled on its own and joins the batch between decode steps; each decode step runs one forward
pass for all rows. Rows are right-aligned in the cache (shorter ones padded on the left) and the attention mask hides
the padding, so each row computes exactly what it would alone; finished rows leave the batch.
"""

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from services.engine.routing import RoutingCapture
from services.engine.sampling import SamplingParams


@dataclass
class Sequence:
    """One sample being generated (a request with n > 1 has n of them)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version that produced each output token
    finish: dict | None = None
    text: str = ""
    num_retractions: int = 0
    cached: int = 0  # positions in the KV cache
    return_routed_experts: bool = False  # asked for, and the server captures routing
    routed_experts_start_len: int = 0
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] of each forward
    lora: str | None = None  # the LoRA adapter it is generated with (lora_path), None for the base model

    @property
    def next_input(self) -> int:
        return self.output_ids[-1]


class Batcher:
    def __init__(self, model: torch.nn.Module, device: torch.device, routing: RoutingCapture | None = None,
                 adapters=None):  # fmt: skip
        self.model, self.device, self.routing, self.adapters = model, device, routing, adapters
        self.rows: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, cache length], 1 where a row has a real position

    @torch.no_grad()
    def prefill(self, sequences: list[Sequence]) -> list[torch.Tensor]:
        """Runs the sequences' prompts (with any output kept across a retraction) in one forward pass, left-padded,
        adds them as rows, and returns each one's logits over its own positions [length, vocab]."""
        ids = [seq.prompt_ids + seq.output_ids for seq in sequences]
        width = max(map(len, ids))
        inputs = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        for row, tokens in enumerate(ids):
            inputs[row, width - len(tokens) :] = torch.tensor(tokens, device=self.device)
            mask[row, width - len(tokens) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self._adapt(sequences)
        with self._routing(sequences, inputs.shape) as routed:
            out = self.model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True)
        for row, (seq, tokens) in enumerate(zip(sequences, ids, strict=True)):
            seq.cached = len(tokens)
            if routed and seq.return_routed_experts:  # replaces any rows from before a retraction
                seq.routed_experts = [routed[0][row, width - len(tokens) :].clone()]
        self._join(sequences, out.past_key_values, mask)
        return [out.logits[row, width - len(tokens) :] for row, tokens in enumerate(ids)]

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step for every row: feeds each row's last token; returns the next-token logits [rows, vocab]."""
        inputs = torch.tensor([[seq.next_input] for seq in self.rows], device=self.device)
        positions = torch.tensor([[seq.cached] for seq in self.rows], device=self.device)
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=self.device)], 1)
        self._adapt(self.rows)
        with self._routing(self.rows, inputs.shape) as routed:
            out = self.model(
                input_ids=inputs,
                position_ids=positions,
                attention_mask=self.mask,
                past_key_values=self.cache,
                use_cache=True,
            )
        self.cache = out.past_key_values
        for row, seq in enumerate(self.rows):
            seq.cached += 1
            if routed and seq.return_routed_experts:
                seq.routed_experts.append(routed[0][row].clone())
        return out.logits[:, -1]

    def _adapt(self, sequences: list[Sequence]) -> None:
        """The forward's rows' LoRA adapters (services/engine/lora.py)."""
        if self.adapters is not None:
            self.adapters.rows = [seq.lora for seq in sequences]

    def _routing(self, sequences: list[Sequence], shape: torch.Size):
        """Captures the forward's routing only when a sequence in it asked for it (SGLang's return_routed_experts)."""
        if self.routing is None:
            return contextlib.nullcontext([])
        return self.routing.forward(tuple(shape), any(seq.return_routed_experts for seq in sequences))

    def _join(self, sequences: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        width = max(mask.shape[1], self.mask.shape[1] if self.rows else 0)
        joined = DynamicCache()
        for index, layer in enumerate(cache.layers):
            keys, values = _left_pad(layer.keys, width), _left_pad(layer.values, width)
            if self.rows:
                old = self.cache.layers[index]
                keys = torch.cat([_left_pad(old.keys, width), keys])
                values = torch.cat([_left_pad(old.values, width), values])
            joined.update(keys, values, index)
        new_mask = _left_pad(mask, width, dim=1)
        old_mask = _left_pad(self.mask, width, dim=1) if self.rows else new_mask[:0]
        self.cache, self.mask = joined, torch.cat([old_mask, new_mask])
        self.rows.extend(sequences)

    def drop(self, leaving: list[Sequence]) -> None:
        """Removes finished (or retracted) rows from the batch."""
        keep = [i for i, seq in enumerate(self.rows) if seq not in leaving]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(keep, device=self.device)
        trimmed = DynamicCache()
        start = int((self.mask[index].sum(0) > 0).nonzero()[0])  # columns no remaining row uses are dropped
        for i, layer in enumerate(self.cache.layers):
            trimmed.update(layer.keys[index, :, start:], layer.values[index, :, start:], i)
        self.cache, self.mask = trimmed, self.mask[index, start:]


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)
