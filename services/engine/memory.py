"""The engine's weights out of and back into GPU memory (`/release_memory_occupation`, `/resume_memory_occupation`),
for a trainer colocated on the same GPU. As SGLang's `--enable-weights-cpu-backup` does, the weights wait in host
memory; page-locked, and allocated once, so that each move is one copy at the host link's speed (about 20 ms a GB on
an H200) rather than a fresh pageable allocation and a slower copy every step."""

import torch

ALIGN = 512  # bytes: each view starts on a boundary every dtype's elements divide


def host_views(tensors: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """One host buffer for all of `tensors` (page-locked with `pin`), as one view of each tensor's shape and dtype.
    One allocation: torch rounds each page-locked allocation up to a power of two, which for a model's tensors one by
    one would add about a third."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // ALIGN) * ALIGN)
    flat = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=pin)
    return [
        flat[start : start + size].view(t.dtype).view(t.shape)
        for t, start, size in zip(tensors, offsets, sizes, strict=False)  # offsets has one more: the total
    ]


class HostCopy:
    """Page-locked host tensors, views of one buffer, one per parameter and buffer of the model, made at the first
    release."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.host: list[torch.Tensor] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def release(self) -> None:
        if self.device.type != "cuda":
            return  # already in host memory
        tensors = self._tensors()
        if self.host is None:
            self.host = host_views(tensors, pin=True)
        for t, host in zip(tensors, self.host, strict=True):
            host.copy_(t.data, non_blocking=True)
        torch.cuda.synchronize(self.device)
        for t, host in zip(tensors, self.host, strict=True):
            t.data = host  # the device memory is the caching allocator's again (empty_cache returns it)

    def resume(self) -> None:
        if self.device.type != "cuda" or self.host is None:
            return
        for t in self._tensors():
            if t.device.type != "cuda":
                t.data = t.data.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)
