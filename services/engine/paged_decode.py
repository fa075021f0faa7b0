"""The decode step's attention on a GPU: one Triton kernel reads, for each sequence and key-value head, only the
blocks the sequence holds (flash-decoding: an online softmax over tiles of positions), and where the batch is too
small to fill the GPU, splits each sequence's positions over several programs and merges their partial results in a
second kernel. The same arithmetic in PyTorch is `attention.decode_reference`, which the CPU runs and the GPU tests
compare against. Used when Triton imports and the keys and values share one power-of-two head dimension."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


if triton is not None:

    @triton.jit
    def _partial(Q, K, V, Tables, Rows, Lengths, Out, Lse, scale,
                 stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_t,
                 stride_ob, stride_oh, stride_os,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr,
                 TILE: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
        b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(Lengths + b).to(tl.int32)
        table = Tables + tl.load(Rows + b).to(tl.int64) * stride_t
        per_split = tl.cdiv(tl.cdiv(length, SPLITS), TILE) * TILE
        start = split * per_split
        end = tl.minimum(start + per_split, length)
        group = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + group
        dims = tl.arange(0, DIM)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=group[:, None] < GROUP,
                    other=0.0)  # fmt: skip
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for first in range(start, end, TILE):
            positions = first + tl.arange(0, TILE)
            valid = positions < end
            block = tl.load(table + positions // PAGE, mask=valid, other=0).to(tl.int64)
            slots = block * PAGE + positions % PAGE
            k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=valid[:, None],
                        other=0.0)  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # ieee: float32 models exact
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            weights = tl.exp(scores - new_top[:, None])
            shrink = tl.exp(top - new_top)
            total = total * shrink + tl.sum(weights, 1)
            v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=valid[:, None],
                        other=0.0)  # fmt: skip
            acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            top = new_top
        some = total > 0
        out = acc / tl.where(some, total, 1.0)[:, None]
        lse = tl.where(some, top + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        keep = group < GROUP
        base = b * stride_ob + heads * stride_oh + split * stride_os
        tl.store(Out + base[:, None] + dims[None, :], out.to(Out.dtype.element_ty), mask=keep[:, None])
        tl.store(Lse + (b * tl.num_programs(1) * GROUP + heads) * SPLITS + split, lse, mask=keep)

    @triton.jit
    def _merge(Part, Lse, Out, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
               HEADS: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
        b, head = tl.program_id(0), tl.program_id(1)
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, DIM)
        lse = tl.load(Lse + (b * HEADS + head) * SPLITS + splits)
        weights = tl.exp(lse - tl.max(lse, 0))
        weights = weights / tl.sum(weights, 0)
        part = tl.load(Part + b * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :])
        out = tl.sum(part.to(tl.float32) * weights[:, None], 0)
        tl.store(Out + b * stride_ob + head * stride_oh + dims, out.to(Out.dtype.element_ty))


class PagedDecode:
    """The kernel for one device; `make` gives None where it cannot run (no Triton). The defaults are the fastest of
    bench/paged_decode.py's grid on an H200 (4.0 TB/s reading 256 sequences of about 1,100 positions)."""

    def __init__(self, device: torch.device, tile: int = 128, warps: int = 4, stages: int = 2, waves: int = 2,
                 max_splits: int = 16):  # fmt: skip
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.tile, self.warps, self.stages, self.waves, self.max_splits = tile, warps, stages, waves, max_splits

    @classmethod
    def make(cls, device: torch.device):
        return cls(device) if triton is not None else None

    @staticmethod
    def supports(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        dim = query.shape[-1]
        return keys.shape[-1] == values.shape[-1] == dim and dim >= 16 and dim & (dim - 1) == 0

    def splits(self, rows: int, kv_heads: int) -> int:
        """Programs a sequence's positions are spread over: enough for `waves` programs a multiprocessor."""
        wanted = -(-self.waves * self.num_sms // (rows * kv_heads))
        return min(self.max_splits, 1 << max(wanted - 1, 0).bit_length())

    def __call__(self, query, keys, values, tables, rows, lengths, block_size: int, scale: float) -> torch.Tensor:
        """query [rows, heads, dim]; keys, values [slots, kv heads, dim] -> [rows, heads, dim]."""
        num, heads, dim = query.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        splits = self.splits(num, kv_heads)
        out = torch.empty_like(query)
        part = out[:, :, None] if splits == 1 else query.new_empty(num, heads, splits, dim)
        lse = torch.empty(num, heads, splits, dtype=torch.float32, device=query.device)
        _partial[(num, kv_heads, splits)](
            query, keys, values, tables, rows, lengths, part, lse, scale,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
            tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, PAGE=block_size,
            TILE=self.tile, SPLITS=splits, num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        if splits > 1:
            _merge[(num, heads)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
                                 out.stride(1), HEADS=heads, DIM=dim, SPLITS=splits)  # fmt: skip
        return out
