"""The trainer's tensors of a sync, apart from the transports that use them (a transport module is imported by the
gateway too, which runs without torch): the streamed path's staging buffers, its copies' bookkeeping and a bucket's
specs as torch types."""

import torch

from services.weightsync.group import bucket_layout, copy_all, places_of


class Staging:
    """The staging buffers of a layout's syncs, with each bucket's dtypes, shapes and places in them, made once and
    kept by the sender from one sync to the next (the last sync's transport held its buffers until the next anyway):
    a bucket is then written with a copy call or two and no view made."""

    def __init__(self, layout: list, stages: int, device):
        self.layout, self.stages, self.device = layout, stages, device
        self.types = [types(specs) for specs in layout]
        self.layouts = [bucket_layout(*types) for types in self.types]  # each bucket's offsets and size
        size = max((size for _, size in self.layouts), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(stages)]
        self.places: dict[int, list[torch.Tensor]] = {}  # by bucket, in buffer index % stages

    def fits(self, layout: list | None, stages: int, device) -> bool:
        """Whether it serves a sync of `layout` (None: a sync with no plan yet, which grows the buffers it needs)."""
        return (layout is None or layout is self.layout) and self.stages == stages and self.device == device

    def write(self, index: int, tensors) -> torch.Tensor:
        """Bucket `index` of the layout written into its buffer; the bucket's part of it."""
        buffer, (offsets, size), tensors = self.buffers[index % self.stages], self.layouts[index], list(tensors)
        if index not in self.places:
            self.places[index] = places_of(buffer, tensors, self.types[index][0], offsets)
        copy_all(self.places[index], tensors)
        return buffer[:size]

    def fit(self, index: int, size: int) -> torch.Tensor:
        """Bucket `index`'s buffer, of at least `size` bytes (a sync with no plan yet: its buckets' sizes come one by
        one)."""
        stage = index % self.stages
        if self.buffers[stage].numel() < size:
            self.buffers[stage] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[stage]


def has_copy(copies: list[torch.Tensor], index: int, flat: torch.Tensor) -> bool:
    """Whether the sender holds a copy of bucket `index` as laid out now."""
    return index < len(copies) and copies[index].numel() == flat.numel()


def types(specs: list) -> tuple[list[torch.dtype], list[list[int]]]:
    return [getattr(torch, s.dtype) for s in specs], [list(s.shape) for s in specs]
