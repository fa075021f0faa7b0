"""The attention of prompt chunks on a GPU: one Triton kernel reads each chunk's keys and values from the blocks its
sequence holds (the cached positions before the chunk and the chunk's own, just written) and attends causally, in
tiles of query positions with an online softmax (flash-attention over a block table, as vLLM's prefix-prefill
kernel). No chunk is padded to another's length and nothing is gathered first: a layer's attention is one launch,
where PyTorch's path (`attention.chunk_plan`, which the CPU runs and the GPU tests compare against) pads chunks into
batches, gathers their keys and masks them. The query heads that share a key head are rows of one tile."""

import torch

from services.engine.transfer import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


if triton is not None:

    @triton.jit
    def _prefill(Q, K, V, Out, Tables, TileChunk, TileFirst, ChunkRow, ChunkStart, ChunkLen, ChunkOffset, scale,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_t, stride_ot, stride_oh,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, DIM: tl.constexpr,
                 PAGE: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
        tile, kv_head = tl.program_id(0), tl.program_id(1)
        chunk = tl.load(TileChunk + tile)
        first = tl.load(TileFirst + tile)  # the tile's first query among the chunk's
        start = tl.load(ChunkStart + chunk)  # the chunk's first position in its sequence
        count = tl.load(ChunkLen + chunk)
        offset = tl.load(ChunkOffset + chunk)  # its first token among the step's chunk tokens
        table = Tables + tl.load(ChunkRow + chunk).to(tl.int64) * stride_t
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)  # row r: query first + r // GROUP_PAD, head r % GROUP_PAD
        within = first + rows // GROUP_PAD
        group = rows % GROUP_PAD
        real = (within < count) & (group < GROUP)
        heads = kv_head * GROUP + group
        tokens = (offset + within).to(tl.int64)
        dims = tl.arange(0, DIM)
        q = tl.load(Q + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=real[:, None],
                    other=0.0)  # fmt: skip
        positions = start + within  # each row's query position: it sees the keys up to its own
        top = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM], tl.float32)
        end = start + tl.minimum(first + BLOCK_M, count)  # past the tile's last query position
        for key_first in range(0, end, TILE):
            keys_at = key_first + tl.arange(0, TILE)
            valid = keys_at < end
            block = tl.load(table + keys_at // PAGE, mask=valid, other=0).to(tl.int64)
            slots = block * PAGE + keys_at % PAGE
            k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=valid[:, None],
                        other=0.0)  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # ieee: float32 models exact
            seen = valid[None, :] & (keys_at[None, :] <= positions[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that sees nothing yet (padding)
            weights = tl.exp(scores - safe[:, None])
            shrink = tl.exp(top - safe)
            total = total * shrink + tl.sum(weights, 1)
            v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=valid[:, None],
                        other=0.0)  # fmt: skip
            acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(Out + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=real[:, None])  # fmt: skip


class PagedPrefill:
    """The kernel for one device; `make` gives None where it cannot run (no Triton)."""

    def __init__(self, rows: int = 64, tile: int = 64, warps: int = 4, stages: int = 2):
        self.rows, self.tile, self.warps, self.stages = rows, tile, warps, stages

    @classmethod
    def make(cls, device: torch.device):
        return cls() if triton is not None and device.type == "cuda" else None

    @staticmethod
    def supports(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        dim = query.shape[-1]
        return keys.shape[-1] == values.shape[-1] == dim and dim >= 16 and dim & (dim - 1) == 0

    def block_m(self, group: int) -> int:
        """Query positions a tile: `rows` rows of (position, head) pairs, at least 16 positions."""
        return max(16, self.rows // triton.next_power_of_2(group))

    def plan(self, rows: list[int], starts: list[int], lens: list[int], group: int, device: torch.device):
        """The step's tiles (each chunk's query positions in tiles of `block_m`): their count, and on the device
        their chunks and first queries, and the chunks' rows, starts, lengths and first tokens; made once a step,
        for every layer. Each row of the two tables starts 16 bytes aligned (its length padded to a multiple of
        four): Triton compiles a kernel for each alignment of its pointers, which would otherwise vary with the
        counts (a compilation of 0.2-0.5 s inside a step, seen on an H200)."""
        block_m = self.block_m(group)
        tile_chunk, tile_first, offsets, offset = [], [], [], 0
        for i, count in enumerate(lens):
            firsts = range(0, count, block_m)
            tile_chunk += [i] * len(firsts)
            tile_first += firsts
            offsets.append(offset)
            offset += count
        tiles = torch.tensor([_aligned(tile_chunk), _aligned(list(tile_first))], dtype=torch.int32)
        chunks = torch.tensor([_aligned(values) for values in (rows, starts, lens, offsets)], dtype=torch.int32)
        return len(tile_chunk), to_device(tiles, device), to_device(chunks, device)

    def __call__(self, query, keys, values, tables, plan, block_size: int, scale: float) -> torch.Tensor:
        """query [chunk tokens, heads, dim]; keys, values [slots, kv heads, dim] -> [chunk tokens, heads, dim]."""
        heads, dim = query.shape[1:]
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        count, tiles, chunks = plan
        out = torch.empty_like(query)
        _prefill[(count, kv_heads)](
            query, keys, values, out, tables, tiles[0], tiles[1], chunks[0], chunks[1], chunks[2], chunks[3], scale,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
            tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=self.block_m(group), DIM=dim,
            PAGE=block_size, TILE=self.tile, num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return out


def _aligned(values: list[int]) -> list[int]:
    """`values` padded with zeros to a multiple of four (16 bytes of int32)."""
    return values + [0] * (-len(values) % 4)
