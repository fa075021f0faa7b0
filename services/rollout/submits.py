"""A gateway's training groups completed in the buffer's Redis, those finished at the same moment in one round trip
(services/buffer/dataplane.py): at thousands of groups a second, a round trip per group costs the gateway more than
its groups' other Redis work.

As for scores (scoring.py), nothing waits for a batch to fill: the groups submitted while the event loop runs one
round go out at the end of that round, so a lone group is sent at once. A group the checks refuse fails alone, before
it joins a batch; a failed round trip fails each of its groups, which go back to the buffer.
"""

import asyncio

from services.buffer.dataplane import Completion, DataPlane, completed_now, completion
from slipstream.v1 import buffer_pb2, common_pb2

MAX_GROUPS = 256  # a round trip's groups at most


class SubmitBatcher:
    def __init__(self):
        self._waiting: dict[DataPlane, list[tuple[Completion, asyncio.Future]]] = {}
        self._sending: set[asyncio.Task] = set()

    async def complete(self, store: DataPlane, lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> bool:
        """As dataplane.complete_in_redis: True when the group was completed now, False when it had been already."""
        entry = completion(lease, group)
        future = asyncio.get_running_loop().create_future()
        batch = self._waiting.setdefault(store, [])
        if not batch:
            asyncio.get_running_loop().call_soon(self._flush, store)
        batch.append((entry, future))
        if len(batch) >= MAX_GROUPS:
            self._flush(store)
        return completed_now(store, lease.lease_id, await future)

    def _flush(self, store: DataPlane) -> None:
        batch = self._waiting.pop(store, None)
        if batch:
            task = asyncio.create_task(self._send(store, batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, store: DataPlane, batch: list) -> None:
        try:
            results = await store.complete([entry for entry, _ in batch])
        except Exception as e:  # Redis failed: each group goes back to the buffer
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its group may have been cancelled meanwhile
                future.set_result(result)
