"""The per-token arrays of samples and prompt groups: token ids (int32), loss masks (uint8) and log-probs (float32),
stored in the protos as little-endian bytes. Decoding returns a read-only numpy view of the bytes, without a copy.
"""

from collections.abc import Sequence

import numpy as np

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
