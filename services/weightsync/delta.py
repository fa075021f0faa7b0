"""Delta weight sync (`--update-weight-mode delta`): a streamed bucket (`bucket_layout`: its tensors' bytes at aligned
offsets) travels as the 2-byte words that changed since the receiver's copy of it, and the receiver applies them to
that copy, bit for bit.

Each bucket goes as two broadcasts: a header (int64: the encoding, the changed words, then each tensor's checksum)
and the payload, in whichever encoding is smallest for this bucket:

- FULL: the bucket itself (2 bytes a word), when most words changed;
- INDICES: each changed word's index (int32) then the changed words: 6 bytes a change;
- BITMASK: one bit a word (1 = changed) then the changed words: 1/8 byte a word plus 2 a change.

So a bucket with under 1/32 of its words changed goes as indices, one with more as a bitmask, and one with nearly all
as itself. After applying, the receiver compares each tensor's checksum (the sum of its words) with the sender's:
a copy that was not the base the sender diffed against cannot go unnoticed."""

import functools

import torch

FULL, INDICES, BITMASK = 0, 1, 2


def payload_size(kind: int, changed: int, size: int) -> int:
    """Bytes of a bucket of `size` bytes with `changed` words changed, in encoding `kind`."""
    return {FULL: size, INDICES: 6 * changed, BITMASK: size // 16 + 2 * changed}[kind]


def changes(new: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of the changed words, their count as a one-element tensor), both left on the device: nothing waits."""
    mask = new.view(torch.int16) != base.view(torch.int16)
    return mask, mask.sum()


def smallest(changed: int, size: int) -> int:
    """The encoding with the smallest payload for `changed` words changed in a bucket of `size` bytes."""
    return min((FULL, INDICES, BITMASK), key=lambda kind: payload_size(kind, changed, size))


def payload(kind: int, new: torch.Tensor, mask: torch.Tensor, changed: int) -> torch.Tensor:
    """The payload of encoding `kind` for `new`, whose changed words `mask` marks (`changed` of them, known on the
    host: nothing waits for the device)."""
    if kind == FULL:
        return new
    where = torch.nonzero_static(mask, size=changed).view(-1)
    values = new.view(torch.int16)[where].view(torch.uint8)
    if kind == INDICES:
        return torch.cat([where.to(torch.int32).view(torch.uint8), values])
    bits = (mask.view(-1, 8).to(torch.uint8) * _bits(mask.device)).sum(1, dtype=torch.uint8)
    return torch.cat([bits, values])


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(encoding, changed words, payload) that turns `base` into `new` (uint8 buckets of one size, a multiple of 16
    bytes); the payload is `new` itself for FULL. Waits for the device (the count)."""
    mask, count = changes(new, base)
    changed = int(count)
    kind = smallest(changed, new.numel())
    return kind, changed, payload(kind, new, mask, changed)


def apply(kind: int, changed: int, payload: torch.Tensor, base: torch.Tensor) -> None:
    """Turns `base` (uint8, in place) into the sender's new bucket from an `encode` payload."""
    if kind == FULL:
        base.copy_(payload)
        return
    base16 = base.view(torch.int16)
    values = payload[payload.numel() - 2 * changed :].view(torch.int16)
    if kind == INDICES:
        where = payload[: 4 * changed].view(torch.int32).long()
        base16[where] = values
    elif kind == BITMASK:
        bits = payload[: base.numel() // 16]
        mask = (bits.unsqueeze(1) & _bits(bits.device)).ne(0).view(-1)
        base16.masked_scatter_(mask, values)
    else:
        raise ValueError(f"unknown delta encoding {kind}")


@functools.cache
def _bits(device: torch.device) -> torch.Tensor:
    """Each bit of a byte, on `device`: copied there once, not at every bucket (a copy from the host waits for the
    device)."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def checksums(bucket: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """Each tensor's checksum in a bucket (uint8): the int64 sum of its 2-byte words, one int64 each."""
    sums = [bucket[o : o + n].view(torch.int16).sum(dtype=torch.int64) for o, n in zip(offsets, sizes, strict=True)]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=bucket.device)


def header(kind: int, changed: int, sums: torch.Tensor) -> torch.Tensor:
    """The int64 tensor broadcast before a bucket's payload: encoding, changed words, each tensor's checksum. Made on
    the device without a copy from the host: a blocking one would wait for all the GPU work queued (the next
    bucket's conversion and comparison) before the sender could go on."""
    head = torch.empty(2 + sums.numel(), dtype=torch.int64, device=sums.device)
    head[:1].fill_(kind)
    head[1:2].fill_(changed)
    head[2:].copy_(sums)
    return head
