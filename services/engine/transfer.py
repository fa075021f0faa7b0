"""Copies from the host to the device that do not wait for the device's queued work.

The engine thread queues a step while the GPU still runs the one before (services/engine/core.py). A copy from
pageable memory to the GPU waits for the stream's queued work first, which would undo that overlap; a copy from
page-locked memory is queued like any kernel. PyTorch's caching host allocator keeps the page-locked tensor until
its copy is done.
"""

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
