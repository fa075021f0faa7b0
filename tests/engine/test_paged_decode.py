"""The decode step's Triton kernel (services/engine/paged_decode.py) against the same attention in PyTorch, over
blocks scattered through the pool, for a batch that fills the GPU (one program a sequence and head) and one too
small for it (positions split over programs, then merged)."""

import pytest
import torch

from services.engine.attention import decode_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(256, 16, 8, 128), (3, 9, 3, 64), (1, 16, 8, 128)])
def test_the_kernel_equals_pytorch(rows, heads, kv_heads, dim):
    from services.engine.paged_decode import PagedDecode

    device, block_size = torch.device("cuda"), 16
    generator = torch.Generator(device).manual_seed(0)
    lengths = torch.randint(1, 700, (rows,), device=device, generator=generator)
    width = 704 // block_size
    num_blocks = rows * width + 1
    tables = torch.randperm(num_blocks - 1, device=device, generator=generator)[: rows * width] + 1
    tables = torch.cat([torch.zeros(1, width, dtype=torch.int64, device=device), tables.view(rows, width)])
    keys, values = (torch.randn(num_blocks * block_size, kv_heads, dim, device=device, dtype=torch.bfloat16,
                                generator=generator) for _ in range(2))  # fmt: skip
    query = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16, generator=generator)
    table_rows = torch.arange(1, rows + 1, device=device)
    kernel = PagedDecode.make(device)
    got = kernel(query, keys, values, tables.to(torch.int32), table_rows, lengths, block_size, dim**-0.5)
    expected = decode_reference(query.float(), keys.float(), values.float(), tables, table_rows, lengths, block_size,
                                width * block_size, dim**-0.5)  # fmt: skip
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
