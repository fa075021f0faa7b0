"""The per-token arrays of samples and prompt groups: token ids (int32), loss masks (uint8) and log-probs (float32),
stored in the protos as little-endian bytes. Decoding returns a read-only numpy view of the bytes, without a copy.
"""

from collections.abc import Sequence

import numpy as np

from slipstream.v1 import common_pb2

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")


def encode_tokens(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def decode_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def encode_mask(mask: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(mask, dtype=MASK_DTYPE).tobytes()


def decode_mask(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=MASK_DTYPE)


def encode_logprobs(logprobs: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(logprobs, dtype=LOGPROB_DTYPE).tobytes()


def decode_logprobs(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=LOGPROB_DTYPE)


def num_tokens(data: bytes) -> int:
    """How many token ids (or log-probs: both are 4 bytes) `data` holds."""
    return len(data) // 4


# The per-token arrays of a sample: a group's bulk. They travel apart from the rest of the group (its metadata) where
# the bytes can skip hops: the worker writes them to Redis, the trainer reads them from there (buffer.proto). Their
# form is a serialized PromptGroup whose samples hold only these fields, encoded and decoded here at the wire level so
# that each array is copied once each way (through the message API it would be copied three times, then twice).
ARRAYS = ("tokens", "loss_mask", "rollout_logprobs", "routed_experts", "teacher_logprobs")
_NUMBERS = [common_pb2.Sample.DESCRIPTOR.fields_by_name[name].number for name in ARRAYS]
_SAMPLES = common_pb2.PromptGroup.DESCRIPTOR.fields_by_name["samples"].number


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint encoding of `value` (>= 0)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def take_arrays(group: common_pb2.PromptGroup) -> bytes:
    """Moves the samples' arrays out of `group`; returns them as a serialized PromptGroup whose samples hold only
    those fields, in order."""
    return take_sized_arrays(group)[0]


def take_sized_arrays(group: common_pb2.PromptGroup) -> tuple[bytes, list[dict[str, int]]]:
    """`take_arrays`, with the byte length of each sample's arrays (by field name): a check of the lengths after
    the arrays are taken out copies none of them again."""
    pieces, sizes = [], []
    for sample in group.samples:
        fields, size, lengths = [], 0, {}
        for number, name in zip(_NUMBERS, ARRAYS, strict=True):
            if data := getattr(sample, name):
                head = varint(number << 3 | 2) + varint(len(data))
                fields += [head, data]
                size += len(head) + len(data)
                lengths[name] = len(data)
                sample.ClearField(name)
        pieces += [varint(_SAMPLES << 3 | 2) + varint(size), *fields]
        sizes.append(lengths)
    return b"".join(pieces), sizes


def put_arrays(group: common_pb2.PromptGroup, data: bytes) -> None:
    """Puts the arrays `take_arrays` took back into `group`'s samples."""
    view, at, parts = memoryview(data), 0, []
    while at < len(view):
        tag, at = _read_varint(view, at)
        size, at = _read_varint(view, at)
        if tag != _SAMPLES << 3 | 2 or at + size > len(view):
            raise ValueError(f"group {group.group_id}: its arrays are not a PromptGroup of samples' arrays")
        parts.append(view[at : at + size])
        at += size
    if len(parts) != len(group.samples):
        raise ValueError(f"group {group.group_id}: {len(parts)} samples' arrays for {len(group.samples)} samples")
    for sample, part in zip(group.samples, parts, strict=True):
        sample.MergeFromString(part)


def put_batch_arrays(groups: Sequence[common_pb2.PromptGroup], arrays: Sequence[bytes | None]) -> None:
    """Completes a batch's groups (GetBatchResponse.groups) with their arrays, as sent or read from Redis."""
    if len(arrays) != len(groups):
        raise ValueError(f"{len(arrays)} groups' arrays for {len(groups)} groups")
    for group, data in zip(groups, arrays, strict=True):
        if data is None:
            raise ValueError(f"group {group.group_id}: its arrays are not in Redis (was its step committed?)")
        put_arrays(group, data)
