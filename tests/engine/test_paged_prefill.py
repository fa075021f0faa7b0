"""The prompt chunks' Triton kernel (services/engine/paged_prefill.py) against PyTorch's path for them
(`attention.chunk_plan`), over blocks scattered through the pool: chunks that start a prompt and chunks after cached
positions, from one token to several tiles long; one query head a key head, two, three and eight."""

import pytest
import torch

from services.engine import attention

pytestmark = pytest.mark.gpu
DTYPE = torch.bfloat16


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 128), (9, 3, 64), (8, 8, 64), (32, 4, 128)])
def test_the_kernel_equals_pytorch(heads, kv_heads, dim):
    from services.engine.paged_prefill import PagedPrefill

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # cpu: Triton's interpreter
    block_size, width = 16, 40
    generator = torch.Generator(device).manual_seed(0)
    starts, lens = [0, 0, 37, 300, 5, 600], [1, 130, 20, 1, 64, 40]
    rows = len(starts)
    num_blocks = rows * width + 1
    tables = torch.randperm(num_blocks - 1, device=device, generator=generator)[: rows * width] + 1
    tables = torch.cat([torch.zeros(1, width, dtype=torch.int64, device=device), tables.view(rows, width)])
    tables = tables.to(torch.int32)
    keys, values = (torch.randn(num_blocks * block_size, kv_heads, dim, device=device, dtype=DTYPE,
                                generator=generator) for _ in range(2))  # fmt: skip
    query = torch.randn(sum(lens), heads, dim, device=device, dtype=DTYPE, generator=generator)
    chunk_rows = [row + 1 for row in range(rows)]
    pool = attention.KvPool(keys.shape[0])
    pool.keys, pool.values = [keys.float()], [values.float()]
    step = attention.Step(pool, block_size, tables, torch.zeros(0, dtype=torch.long, device=device), 0, None, None,
                          chunk_rows, starts, lens)  # fmt: skip
    batches, order = attention.chunk_plan(step, device, heads // kv_heads)
    outs = [
        attention._attend(query.float()[index].transpose(1, 2), pool.keys[0], pool.values[0], slots, mask, dim**-0.5)
        .transpose(1, 2)
        .flatten(0, 1)[keep]
        for index, slots, mask, keep in batches
    ]
    expected = outs[0] if order is None else torch.cat(outs)[order]
    kernel = PagedPrefill()
    plan = kernel.plan(chunk_rows, starts, lens, heads // kv_heads, device)
    got = kernel(query, keys, values, tables, plan, block_size, dim**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
