"""Attention over the paged KV cache, as a transformers attention implementation (`paged`): the model runs
unchanged on a flat batch [1, tokens] of every sequence's new tokens, and each layer's attention writes those
tokens' keys and values into their slots of the pool, then reads, for each sequence, only the blocks it holds.

What a forward's attention needs to know (the slots, the block tables, where each sequence's tokens lie in the flat
batch) is set by the batcher in `Step` before the forward. The first `num_decode` tokens are sequences that add one
token each (decoding): on a GPU one Triton kernel reads their blocks (services/engine/paged_decode.py); the rest
are chunks of prompts, which another reads causally (services/engine/paged_prefill.py). Both have a PyTorch path,
which the CPU runs (for chunks: SDPA over each chunk's gathered blocks).
"""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.engine.transfer import to_device

NAME = "paged"


class KvPool:
    """Every layer's keys and values, as [slots, kv heads, head dim] (slot = block * block_size + offset). Each
    layer's tensors are made at its first forward, shaped as its keys and values; `resize` grows them all."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def layer(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= index:
            self.keys.append(keys.new_zeros(self.num_slots, *keys.shape[1:]))
            self.values.append(values.new_zeros(self.num_slots, *values.shape[1:]))
        return self.keys[index], self.values[index]

    def resize(self, num_slots: int) -> None:
        """Grows every tensor to `num_slots`, one at a time (at most one old tensor beside the new ones)."""
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                grown = old.new_zeros(num_slots, *old.shape[1:])  # zeros: padded reads are masked, never NaN
                grown[: old.shape[0]].copy_(old)
                tensors[i] = grown
                del old
        self.num_slots = num_slots

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class Step:
    """One forward's layout. Tensors are on the model's device; `slots` [tokens] is where each new token's keys and
    values go. Decoding rows (the first `num_decode` tokens): `rows` [num_decode] their rows of `tables`, `lengths`
    [num_decode] their positions including the new one. Prefill chunks: `chunk_rows`, `chunk_starts` (the first
    position of each chunk) and `chunk_lens`, as CPU lists."""

    pool: KvPool
    block_size: int
    tables: torch.Tensor  # [max rows, max blocks a sequence] int32: each row's blocks
    slots: torch.Tensor
    num_decode: int
    rows: torch.Tensor
    lengths: torch.Tensor
    chunk_rows: list[int]
    chunk_starts: list[int]
    chunk_lens: list[int]
    decode_kernel: object = None  # paged_decode.PagedDecode on a GPU, else None: PyTorch's path
    width: int = 0  # PyTorch's decode path: positions it reads a row (a multiple of block_size, at least the longest)
    prefill_kernel: object = None  # paged_prefill.PagedPrefill on a GPU, else None: PyTorch's path (`chunk_plan`)
    plans: dict = field(default_factory=dict)  # what every layer's attention gathers by, worked out at the first

    def plan(self, kind: str, make):
        if kind not in self.plans:
            self.plans[kind] = make()
        return self.plans[kind]


current: Step | None = None  # set by the batcher around each forward (only the engine thread runs forwards)


def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: query [1, heads, tokens, dim], key and value [1, kv heads, tokens, dim];
    returns [1, tokens, heads, value dim]."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))
    return torch.ops.slipstream.paged_attention(query, key, value, module.layer_idx, scale)[None], None


@torch.library.custom_op("slipstream::paged_attention", mutates_args=())
def _paged(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """One layer's attention for the step in `current`: query [tokens, heads, dim], key and value [tokens, kv heads,
    dim] -> [tokens, heads, value dim]. An operator of its own, opaque to torch.compile (which compiles the rest of
    the model, services/engine/compiled.py): it reads the step's layout and writes the pool, which no graph holds."""
    step = current
    keys, values = step.pool.layer(layer, key, value)
    keys.index_copy_(0, step.slots, key)
    values.index_copy_(0, step.slots, value)
    parts = []
    if step.num_decode:
        q = query[: step.num_decode]
        if step.decode_kernel is not None and step.decode_kernel.supports(q, keys, values):
            parts.append(step.decode_kernel(q, keys, values, step.tables, step.rows, step.lengths, step.block_size,
                                            scale))  # fmt: skip
        else:
            slots, visible = step.plan("decode", lambda: decode_plan(step.tables, step.rows, step.lengths,
                                                                     step.block_size, step.width))  # fmt: skip
            mask = step.plan("decode mask", lambda: grouped_mask(visible, query.shape[1] // keys.shape[1]))
            parts.append(_attend(q[:, :, None], keys, values, slots, mask, scale)[:, :, 0])
    if step.chunk_lens:
        chunked, kernel, group = query[step.num_decode :], step.prefill_kernel, query.shape[1] // keys.shape[1]
        if kernel is not None and kernel.supports(chunked, keys, values):
            plan = step.plan("prefill", lambda: kernel.plan(step.chunk_rows, step.chunk_starts, step.chunk_lens, group,
                                                            query.device))  # fmt: skip
            parts.append(kernel(chunked, keys, values, step.tables, plan, step.block_size, scale))
        else:
            parts.append(_chunks_in_pytorch(step, chunked, keys, values, group, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunks_in_pytorch(step: Step, chunked, keys, values, group: int, scale: float) -> torch.Tensor:
    """The prompt chunks' attention by SDPA over their gathered blocks (`chunk_plan`): [chunk tokens, heads, dim]."""
    batches, order = step.plan("chunks", lambda: chunk_plan(step, chunked.device, group))
    with _prefill_backends(chunked.device):
        outs = [_attend(chunked[index].transpose(1, 2), keys, values, slots, mask, scale).transpose(1, 2)
                .flatten(0, 1)[keep] for index, slots, mask, keep in batches]  # fmt: skip
    return outs[0] if order is None else torch.cat(outs)[order]


@_paged.register_fake
def _(query, key, value, layer, scale):
    return query.new_empty(*query.shape[:2], value.shape[-1])


def decode_reference(query, keys, values, tables, rows, lengths, block_size: int, width: int, scale: float):
    """Each decoding row's attention over its first `width` positions' blocks, in PyTorch: query [rows, heads, dim]
    -> [rows, heads, v dim]."""
    slots, visible = decode_plan(tables, rows, lengths, block_size, width)
    mask = grouped_mask(visible, query.shape[1] // keys.shape[1])
    return _attend(query[:, :, None], keys, values, slots, mask, scale)[:, :, 0]


def decode_plan(tables, rows, lengths, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each decoding row reads [rows, width] and which of them it sees [rows, 1, width]."""
    positions = torch.arange(width, device=tables.device)
    slots = tables[rows.long()][:, positions // block_size].long() * block_size + positions % block_size
    return slots, (positions[None, :] < lengths[:, None])[:, None, :]


def chunk_plan(
    step: Step, device: torch.device, groups: int
) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor | None]:
    """Prompt chunks padded into batches, one a length class (`_length_class`: a step's hundreds of few-token tails
    of shared prompts are not padded to its longest prompt). For each batch [chunks, longest]: each padded query's
    token among the step's chunk tokens, the slots each chunk reads [chunks, width] (on a GPU a multiple of 16, as
    the attention kernels align their masks), which of them each query sees (its sequence's positions up to its own:
    the cached ones before the chunk and the chunk's own; `grouped_mask`, for `groups` query heads a key head) and
    the batch's rows that are real tokens. `order`: where each chunk token's row is in the batches' rows, joined
    (None for one batch). Made on the CPU and moved once a step, for every layer."""
    starts, lens = torch.tensor(step.chunk_starts), torch.tensor(step.chunk_lens)
    offsets, total = torch.cumsum(lens, 0) - lens, int(lens.sum())  # each chunk's first token among the step's
    classes: dict[int, list[int]] = {}
    for i, count in enumerate(step.chunk_lens):
        classes.setdefault(_length_class(count), []).append(i)
    batches, tokens = [], []
    for members in classes.values():
        chosen = torch.tensor(members)
        first, count, offset = starts[chosen], lens[chosen], offsets[chosen]
        longest, width = int(count.max()), int((first + count).max())
        width = -(-width // 16) * 16 if device.type == "cuda" else width  # the GPU kernels' mask alignment
        within = torch.arange(longest)
        index = (offset[:, None] + within).clamp(max=total - 1)
        positions = torch.arange(width)
        visible = positions[None, None, :] <= (first[:, None] + within)[:, :, None]
        real = (within[None, :] < count[:, None]).flatten()
        keep = real.nonzero()[:, 0]
        tokens.append(index.flatten()[real])
        rows = torch.tensor([step.chunk_rows[i] for i in members])
        index, positions, visible, keep, rows = (to_device(t, device) for t in (index, positions, visible, keep, rows))
        tables = step.tables[rows]
        slots = tables[:, positions // step.block_size].long() * step.block_size + positions % step.block_size
        batches.append((index, slots, grouped_mask(visible, groups), keep))
    order = None if len(batches) == 1 else to_device(torch.argsort(torch.cat(tokens)), device)
    return batches, order


def _length_class(count: int) -> int:
    """Chunks of 1-16 tokens, 17-64, 65-256, …: padded together, each at most four times its length."""
    size = 16
    while size < count:
        size *= 4
    return size


def grouped_mask(visible: torch.Tensor, groups: int) -> torch.Tensor:
    """`visible` [n, q, width] repeated for the `groups` query heads that share a key head: [n, 1, groups * q,
    width], as `_attend` lays them out."""
    n, q, width = visible.shape
    return visible[:, None, None].expand(n, 1, groups, q, width).reshape(n, 1, groups * q, width)


def _attend(query, keys, values, slots, mask, scale: float) -> torch.Tensor:
    """query [n, heads, q, dim] over the pool's `keys` and `values` at `slots` [n, width], `mask` [n, 1, groups * q,
    width] (`grouped_mask`) -> [n, heads, q, v dim]. Grouped-query attention without repeating the keys: the query
    heads that share a key head are laid end to end as more queries of it ([n, kv heads, groups * q, dim]), the mask
    repeated to match (SDPA's kernels that take a mask do not all take groups)."""
    n, heads, q, dim = query.shape
    kv_heads = keys.shape[1]
    k, v = keys[slots].transpose(1, 2), values[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(query.reshape(n, kv_heads, heads // kv_heads * q, dim), k, v,
                                         attn_mask=mask, scale=scale)  # fmt: skip
    return out.reshape(n, heads, q, -1)


def _prefill_backends(device: torch.device):
    """SDPA's kernels for prompt chunks on a GPU: not cuDNN's, which builds a plan for every new shape (a prefill
    step's shapes are new each time: 164 ms of a 362 ms step on an H200, 2026-12-02), but the memory-efficient
    kernel, which takes the mask as it is."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention)
