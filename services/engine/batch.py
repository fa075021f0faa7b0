"""Continuous batching over one HF model: every running sequence is a row of the engine's KV cache.

New sequences are prefilled together (left-padded, with the model's own cache) and join the batch between decode
steps; their keys and values move into rows of `SlotCache`, where each row holds its sequence's positions from column
0 on. A decode step runs one forward pass for all rows, each writing its new position at its own column, and the
attention mask hides what lies beyond each row's length, so each row computes exactly what it would alone. Finished
rows leave, and the last rows move into their places, so that the batch stays rows 0…n-1. The decode step's shapes
change only with the batch's row count and the cache's size, which lets a CUDA graph replay it
(services/engine/graphs.py).
"""

import contextlib
from dataclasses import dataclass, field

import torch

from services.engine.graphs import DecodeGraphs
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
                 adapters=None, graphs: DecodeGraphs | None = None):  # fmt: skip
        self.model, self.device, self.routing, self.adapters, self.graphs = model, device, routing, adapters, graphs
        self.rows: list[Sequence] = []  # row i is row i of the cache
        self.cache = SlotCache(device, graphs is not None)

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
        if self.cache.fit(len(self.rows) + len(sequences), width, out.past_key_values):
            self._drop_graphs()
        self.cache.join(len(self.rows), [len(tokens) for tokens in ids], out.past_key_values)
        self.rows.extend(sequences)
        return [out.logits[row, width - len(tokens) :] for row, tokens in enumerate(ids)]

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step for every row: feeds each row's last token; returns the next-token logits [rows, vocab]."""
        count = len(self.rows)
        if self.cache.fit(count, max(seq.cached for seq in self.rows) + 1):
            self._drop_graphs()
        rows = self.cache.rows_for(count)  # with CUDA graphs, a bucket of rows; those past `count` are idle
        feed = torch.zeros(rows, 2, dtype=torch.long)
        feed[:count] = torch.tensor([[seq.next_input, seq.cached] for seq in self.rows])
        self.cache.inputs[:rows].copy_(feed, non_blocking=True)
        self._adapt(self.rows + [None] * (rows - count))
        with self._routing(self.rows, (rows, 1)) as routed:
            if self.graphs is not None and self.adapters is None and self.routing is None:  # hooks run eagerly
                logits = self.graphs.run(rows, lambda: self._decode(rows))
            else:
                logits = self._decode(rows)
        for row, seq in enumerate(self.rows):
            seq.cached += 1
            if routed and seq.return_routed_experts:
                seq.routed_experts.append(routed[0][row].clone())
        return logits[:count]

    def _decode(self, rows: int) -> torch.Tensor:
        """The decode forward over the first `rows` rows, from the cache's `inputs` (what a CUDA graph captures)."""
        tokens, positions = self.cache.inputs[:rows, :1], self.cache.inputs[:rows, 1:]
        self.cache.positions = positions[:, 0]
        mask = self.cache.columns <= positions  # [rows, columns]: each row's positions up to the new one
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask[:, None, None, :],
                         past_key_values=self.cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1]

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def _adapt(self, sequences: list[Sequence | None]) -> None:
        """The forward's rows' LoRA adapters (services/engine/lora.py)."""
        if self.adapters is not None:
            self.adapters.rows = [seq.lora if seq else None for seq in sequences]

    def _routing(self, sequences: list[Sequence], shape: tuple):
        """Captures the forward's routing only when a sequence in it asked for it (SGLang's return_routed_experts)."""
        if self.routing is None:
            return contextlib.nullcontext([])
        return self.routing.forward(tuple(shape), any(seq.return_routed_experts for seq in sequences))

    def drop(self, leaving: list[Sequence]) -> None:
        """Removes finished (or retracted) rows from the batch: the last rows move into their places."""
        gone = {id(seq) for seq in leaving}
        count = sum(id(seq) not in gone for seq in self.rows)
        if count == len(self.rows):
            return
        holes = [row for row in range(count) if id(self.rows[row]) in gone]
        movers = [row for row in range(count, len(self.rows)) if id(self.rows[row]) not in gone]
        self.cache.move(movers, holes)
        for hole, mover in zip(holes, movers, strict=True):
            self.rows[hole] = self.rows[mover]
        del self.rows[count:]

    def release(self) -> None:
        """Frees the cache and the graphs (an idle engine releasing its GPU memory); both come back when needed."""
        self._drop_graphs()
        self.cache = SlotCache(self.device, self.graphs is not None)


class SlotCache:
    """The running sequences' keys and values: per layer one tensor [rows, kv heads, columns, head dim] for each,
    each row a sequence's positions from column 0 on. Both sizes grow by doubling (the rows up to what a step needs,
    or with CUDA graphs to the next power of two); the model's attention reads it as an HF cache (`update`)."""

    def __init__(self, device: torch.device, buckets: bool):
        self.device, self.buckets = device, buckets
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = self.width = 0
        self.columns = self.index = torch.arange(0, device=device)  # [width] for the mask, [slots] for the rows
        self.inputs = torch.zeros(0, 2, dtype=torch.long, device=device)  # [slots, 2]: each row's next token, position
        self.positions: torch.Tensor | None = None  # [rows]: the column each row writes in this decode step

    def rows_for(self, count: int) -> int:
        """The row count a decode step of `count` sequences runs with."""
        return min(_bucket(count), self.slots) if self.buckets else count

    def fit(self, rows: int, width: int, like=None) -> bool:
        """Makes room for `rows` rows of `width` columns, the first time shaped and typed as the layers of `like` (an
        HF cache); says whether the tensors were replaced."""
        if rows <= self.slots and width <= self.width:
            return False
        slots, width = max(self.slots, _bucket(rows)), max(self.width, _bucket(width))
        held = list(zip(self.keys, self.values, strict=True)) or [(layer.keys, layer.values) for layer in like.layers]
        self.keys, self.values = [], []
        for keys, values in held:
            for grown, old in ((self.keys, keys), (self.values, values)):
                tensor = old.new_zeros(slots, old.shape[1], width, old.shape[3])
                if self.slots:
                    tensor[: old.shape[0], :, : old.shape[2]] = old
                grown.append(tensor)
        self.slots, self.width = slots, width
        self.columns = torch.arange(width, device=self.device)
        self.index = torch.arange(slots, device=self.device)
        self.inputs = torch.zeros(slots, 2, dtype=torch.long, device=self.device)
        return True

    def join(self, first: int, lengths: list[int], cache) -> None:
        """Copies a prefill's rows (left-padded in `cache`, an HF cache) into rows first, first + 1, …; columns past
        a row's length get copies of its last position, which the mask hides until decode steps overwrite them."""
        width = cache.layers[0].keys.shape[2]
        shift = torch.tensor([width - length for length in lengths], device=self.device)
        index = (torch.arange(width, device=self.device) + shift[:, None]).clamp(max=width - 1)[:, None, :, None]
        rows = slice(first, first + len(lengths))
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            keys[rows, :, :width] = layer.keys.gather(2, index.expand_as(layer.keys))
            values[rows, :, :width] = layer.values.gather(2, index.expand_as(layer.values))

    def move(self, sources: list[int], targets: list[int]) -> None:
        if not sources:
            return
        sources_t = torch.tensor(sources, device=self.device)
        targets_t = torch.tensor(targets, device=self.device)
        for tensor in [*self.keys, *self.values]:
            tensor[targets_t] = tensor[sources_t]

    # The HF cache interface a model's attention uses in a decode step

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows = keys.shape[0]
        for target, new in ((self.keys[layer_idx], keys), (self.values[layer_idx], values)):
            target[self.index[:rows], :, self.positions] = new[:, :, 0]
        return self.keys[layer_idx][:rows], self.values[layer_idx][:rows]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


def _bucket(count: int) -> int:
    return 1 << max(count - 1, 0).bit_length()
