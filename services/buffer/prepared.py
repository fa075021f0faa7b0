"""Tokenized chunks of a dataset's stream, shared by the buffer processes of a run through Redis, so that each prompt
is tokenized once however many replicas read the stream ahead of the leases.

The first process to claim a chunk (SET NX of an empty value) tokenizes it and stores it there; the others read it,
polling while it is claimed but not stored yet. The claimer renews its claim while it tokenizes, however long that
takes on a loaded machine; a claim whose process died expires after CLAIM_TTL_MS, and the next process to look claims
the chunk. The process whose lease takes a chunk's last prompt deletes it; one that was never deleted expires.
"""

import asyncio
import contextlib
import json
import struct
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.buffer.prompts import Skipped

CLAIM_TTL_MS = 10_000  # a claim not renewed (its claimer died) frees the key after this long
RENEW_S = 2.0  # how often a claimer renews its claim while it tokenizes
CHUNK_TTL_MS = 3_600_000  # a chunk that no lease finished (the run stopped, a process died) is gone after an hour
POLL_S = 0.005
_LENGTH = struct.Struct("!I")

Payloads = list[bytes | Skipped]


def encode(payloads: Payloads) -> bytes:
    """Each item as a length, then `g` and the serialized PromptGroup, or `s` and [reason, message] as JSON."""
    parts = []
    for payload in payloads:
        if isinstance(payload, Skipped):
            data = b"s" + json.dumps([payload.reason, payload.message]).encode()
        else:
            data = b"g" + payload
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def decode(value: bytes) -> Payloads:
    payloads: Payloads = []
    view, at = memoryview(value), 0
    while at < len(view):
        (size,) = _LENGTH.unpack_from(view, at)
        data = bytes(view[at + _LENGTH.size + 1 : at + _LENGTH.size + size])
        payloads.append(data if view[at + _LENGTH.size] == ord("g") else Skipped(*json.loads(data)))
        at += _LENGTH.size + size
    return payloads


class SharedChunks:
    """The chunks of one stream, under `prefix` (which names the run, the dataset and how rows become prompts)."""

    def __init__(self, redis: Redis, prefix: str):
        self.redis, self.prefix = redis, prefix

    async def prepare(self, chunk: str, tokenize: Callable[[], Awaitable[Payloads]]) -> Payloads:
        """The chunk's payloads: as stored by the process that claimed it, else tokenized here (also while Redis
        cannot be reached: sharing saves work, and a lease fails on its own when Redis is down)."""
        key = f"{self.prefix}:{chunk}"
        while True:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    claimed, value = await pipe.set(key, b"", nx=True, px=CLAIM_TTL_MS).get(key).execute()
            except RedisError:
                return await tokenize()
            if claimed:
                return await self._tokenize_claimed(key, tokenize)
            if value:
                return decode(value)
            await asyncio.sleep(POLL_S)  # claimed: stored soon, or the claim expires and is taken over

    async def _tokenize_claimed(self, key: str, tokenize: Callable[[], Awaitable[Payloads]]) -> Payloads:
        renewing = asyncio.ensure_future(self._renew(key))
        try:
            payloads = await tokenize()
        except BaseException:  # the next process to look claims the chunk again, and finds the same bad row
            with contextlib.suppress(RedisError):
                await asyncio.shield(self.redis.delete(key))
            raise
        finally:
            renewing.cancel()
        with contextlib.suppress(RedisError):  # else the claim expires and another process tokenizes the chunk
            await self.redis.set(key, encode(payloads), px=CHUNK_TTL_MS, xx=True)  # not if leased meanwhile
        return payloads

    async def _renew(self, key: str) -> None:
        """Keeps the claim alive while this process tokenizes (the tokenizer runs in a worker, not on this loop)."""
        while True:
            await asyncio.sleep(RENEW_S)
            with contextlib.suppress(RedisError):
                await self.redis.pexpire(key, CLAIM_TTL_MS)

    async def forget(self, chunks: set[str]) -> None:
        """Deletes chunks whose every prompt was leased (one that stays expires after CHUNK_TTL_MS)."""
        if chunks:
            with contextlib.suppress(RedisError):
                await self.redis.unlink(*(f"{self.prefix}:{chunk}" for chunk in chunks))
