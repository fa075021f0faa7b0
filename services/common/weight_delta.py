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

import torch

FULL, INDICES, BITMASK = 0, 1, 2
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def payload_size(kind: int, changed: int, size: int) -> int:
    """Bytes of a bucket of `size` bytes with `changed` words changed, in encoding `kind`."""
    return {FULL: size, INDICES: 6 * changed, BITMASK: size // 16 + 2 * changed}[kind]


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(encoding, changed words, payload) that turns `base` into `new` (uint8 buckets of one size, a multiple of 16
    bytes); the payload is `new` itself for FULL."""
    new16, base16 = new.view(torch.int16), base.view(torch.int16)
    mask = new16 != base16
    changed = int(mask.sum())
    kind = min((FULL, INDICES, BITMASK), key=lambda k: payload_size(k, changed, new.numel()))
    if kind == FULL:
        return kind, changed, new
    values = new16[mask].view(torch.uint8)
    if kind == INDICES:
        where = mask.nonzero().view(-1).to(torch.int32).view(torch.uint8)
    else:
        where = (mask.view(-1, 8).to(torch.uint8) * _BITS.to(mask.device)).sum(1, dtype=torch.uint8)
    return kind, changed, torch.cat([where, values])


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
        mask = (bits.unsqueeze(1) & _BITS.to(bits.device)).ne(0).view(-1)
        base16.masked_scatter_(mask, values)
    else:
        raise ValueError(f"unknown delta encoding {kind}")


def checksums(bucket: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """Each tensor's checksum in a bucket (uint8): the int64 sum of its 2-byte words, one int64 each."""
    sums = [bucket[o : o + n].view(torch.int16).sum(dtype=torch.int64) for o, n in zip(offsets, sizes, strict=True)]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=bucket.device)


def header(kind: int, changed: int, sums: torch.Tensor) -> torch.Tensor:
    """The int64 tensor broadcast before a bucket's payload: encoding, changed words, each tensor's checksum."""
    return torch.cat([torch.tensor([kind, changed], dtype=torch.int64, device=sums.device), sums])
