"""Finished groups to the buffer, several to a call: while one SubmitGroups call is out, the groups that finish queue
up and go together in the next. Under load a call carries many groups (one RPC and one round of the buffer's work
for all of them); a lone group goes at once, as with SubmitGroup."""

import asyncio

from services.common.errors import SlipstreamError
from slipstream.v1 import buffer_pb2

MAX_GROUPS = 64  # to a call


class Refused(SlipstreamError):
    """The buffer refused this group (the others of its call may have been stored)."""

    def __init__(self, result: buffer_pb2.SubmitGroupResult):
        super().__init__(result.error)
        self.status = result.code


class Submitter:
    def __init__(self, buffer, timeout_s: float = 60):
        self.buffer, self.timeout_s = buffer, timeout_s
        self._queue: list[tuple[buffer_pb2.SubmitGroupRequest, asyncio.Future]] = []
        self._sending: asyncio.Task | None = None

    async def submit(self, request: buffer_pb2.SubmitGroupRequest) -> buffer_pb2.SubmitGroupResponse:
        """The buffer's answer for this group; raises `Refused`, or the call's error (grpc.aio.AioRpcError)."""
        answer = asyncio.get_running_loop().create_future()
        self._queue.append((request, answer))
        if self._sending is None or self._sending.done():
            self._sending = asyncio.create_task(self._send())
        return await answer

    async def _send(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:MAX_GROUPS], self._queue[MAX_GROUPS:]
            request = buffer_pb2.SubmitGroupsRequest(groups=[one for one, _ in batch])
            try:
                reply = await self.buffer.SubmitGroups(request, timeout=self.timeout_s)
                if len(reply.results) != len(batch):
                    raise SlipstreamError(f"the buffer answered {len(reply.results)} of {len(batch)} groups")
            except Exception as e:  # the call failed as a whole: so did each of its groups
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(e)
                continue
            for (_, answer), result in zip(batch, reply.results, strict=True):
                if answer.done():  # its caller was cancelled
                    continue
                if result.HasField("response"):
                    answer.set_result(result.response)
                else:
                    answer.set_exception(Refused(result))
