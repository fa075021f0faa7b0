"""A gateway's training groups completed in the buffer's Redis, those finished at the same moment in one round trip
(services/buffer/dataplane.py): at thousands of groups a second, a round trip per group costs the gateway more than
its groups' other Redis work.

As for scores (scoring.py), nothing waits for a batch to fill: the groups submitted while the event loop runs one
round go out at the end of that round, so a lone group is sent at once. A group the checks refuse fails alone, before
it joins a batch; a failed round trip fails each of its groups, which go back to the buffer.
"""

from services.buffer.dataplane import DataPlane, completed_now, completion
from services.rollout.rounds import RoundBatcher
from slipstream.v1 import buffer_pb2, common_pb2

MAX_GROUPS = 256  # a round trip's groups at most


class SubmitBatcher(RoundBatcher):
    async def complete(self, store: DataPlane, lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> bool:
        """As dataplane.complete_in_redis: True when the group was completed now, False when it had been already."""
        future = self._add(store, completion(lease, group), lambda batch: len(batch) >= MAX_GROUPS)
        return completed_now(store, lease.lease_id, await future)

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
