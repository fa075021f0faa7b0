"""Scores from the reward service, with the items of the groups that are ready at the same moment sent in one Score
call: at thousands of groups a second, one call per group costs the reward service more than scoring does.

Nothing waits for a batch to fill: the items asked for while the event loop runs one round go out at the end of that
round, so a lone group is sent at once. A batch the reward service refuses as a whole is sent again group by group,
so that one group's bad item fails only that group.
"""

import asyncio

import grpc

from services.rollout.rounds import RoundBatcher
from slipstream.v1 import common_pb2, reward_pb2

MAX_ITEMS = 256  # a Score call's items at most (a 64k-token response is ~256 KB of text: well under the message cap)


class ScoreBatcher(RoundBatcher):
    def __init__(self, reward, timeout_s: float = 600.0):
        super().__init__()
        self.reward, self.timeout_s = reward, timeout_s

    async def score(self, items: list[reward_pb2.RewardItem], rm_type: str) -> list[reward_pb2.RewardResult]:
        """The results of `items`, in order (raises the call's AioRpcError when the reward service fails)."""
        return await self._add(rm_type, items, lambda batch: sum(len(i) for i, _ in batch) >= MAX_ITEMS)

    async def _send(self, rm_type: str, batch: list) -> None:
        try:
            results = await self._call(rm_type, [item for items, _ in batch for item in items])
        except grpc.aio.AioRpcError as e:
            if len(batch) > 1 and e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # whose item? each on its own
                await asyncio.gather(*(self._send(rm_type, [entry]) for entry in batch))
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        start = 0
        for items, future in batch:
            if not future.done():  # its group may have been cancelled meanwhile
                future.set_result(results[start : start + len(items)])
            start += len(items)

    async def _call(self, rm_type: str, items: list) -> list[reward_pb2.RewardResult]:
        reply = await self.reward.Score(reward_pb2.ScoreRequest(items=items, rm_type=rm_type), timeout=self.timeout_s)
        return list(reply.results)


def reward_error(result: reward_pb2.RewardResult, rm_type: str) -> common_pb2.RewardError:
    """A failed result as its sample carries it (a reward service that names no reward type or kind: the gateway's
    --rm-type, and "exception")."""
    return common_pb2.RewardError(
        rm_type=result.rm_type or rm_type or "unnamed",
        kind=result.error_kind or "exception",
        message=result.error_message,
        traceback=result.error_traceback,
    )
