"""The engine's host copy of its weights (services/engine/memory.py) on the CPU: one buffer, a view per tensor."""

import torch

from services.engine.memory import ALIGN, host_views


def test_one_buffer_holds_every_tensor_whole_and_apart():
    tensors = [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.randn(7),
        torch.arange(6, dtype=torch.int64).view(2, 3),
        torch.zeros(0),
        torch.tensor([True, False, True]),
    ]
    views = host_views(tensors, pin=False)
    for view, tensor in zip(views, tensors, strict=True):
        view.copy_(tensor)
    assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(views, tensors, strict=True))
    storage = {v.untyped_storage().data_ptr() for v in views}
    assert len(storage) == 1  # one allocation
    starts = [v.storage_offset() * v.element_size() for v in views]  # bytes into the buffer
    assert all(start % ALIGN == 0 for start in starts)
    ends = [start + v.numel() * v.element_size() for start, v in zip(starts, views, strict=True)]
    assert all(end <= later for end, later in zip(ends, starts[1:], strict=False))  # none overlaps the next
