"""The engine's weights out of and back into GPU memory (`/release_memory_occupation`, `/resume_memory_occupation`),
for a trainer colocated on the same GPU. As SGLang's `--enable-weights-cpu-backup` does, the weights wait in host
memory; page-locked, and allocated once, so that each move is one copy at the host link's speed (about 20 ms a GB on
an H200) rather than a fresh pageable allocation and a slower copy every step."""

import torch


class HostCopy:
    """Page-locked host tensors, one per parameter and buffer of the model, made at the first release."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.host: list[torch.Tensor] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def release(self) -> None:
        tensors = self._tensors()
        if self.device.type != "cuda":
            return  # already in host memory
        if self.host is None:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
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
