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
# the bytes can skip hops: the worker writes them to Redis, the trainer reads them from there (buffer.proto).
ARRAYS = ("tokens", "loss_mask", "rollout_logprobs", "routed_experts")


def take_arrays(group: common_pb2.PromptGroup) -> bytes:
    """Moves the samples' arrays out of `group`; returns them as a serialized PromptGroup whose samples hold only
    those fields, in order."""
    arrays = common_pb2.PromptGroup()
    for sample in group.samples:
        part = arrays.samples.add()
        for name in ARRAYS:
            setattr(part, name, getattr(sample, name))
            sample.ClearField(name)
    return arrays.SerializeToString()


def put_arrays(group: common_pb2.PromptGroup, data: bytes) -> None:
    """Puts the arrays `take_arrays` took back into `group`'s samples."""
    arrays = common_pb2.PromptGroup.FromString(data)
    if len(arrays.samples) != len(group.samples):
        raise ValueError(
            f"group {group.group_id}: {len(arrays.samples)} samples' arrays for {len(group.samples)} samples"
        )
    for sample, part in zip(group.samples, arrays.samples, strict=True):
        sample.MergeFrom(part)


def put_batch_arrays(groups: Sequence[common_pb2.PromptGroup], arrays: Sequence[bytes | None]) -> None:
    """Completes a batch's groups (GetBatchResponse.groups) with their arrays, as sent or read from Redis."""
    if len(arrays) != len(groups):
        raise ValueError(f"{len(arrays)} groups' arrays for {len(groups)} groups")
    for group, data in zip(groups, arrays, strict=True):
        if data is None:
            raise ValueError(f"group {group.group_id}: its arrays are not in Redis (was its step committed?)")
        put_arrays(group, data)
