"""How a gateway leases: while the buffer has groups to spare, all its free slots in one LeasePrompts call (each call
costs a buffer replica's event loop about as much as the groups it carries, so many small calls from many gateways
are what saturates the buffers); while groups are scarce (a staleness or backpressure bound is near), a few at a
time, so that one gateway does not take a whole small step's prompts from the others. It never leases more groups
than it has free slots. While a call is out, a second one goes out once half a full call's slots are free, so that
the slots freed meanwhile need not wait for the first call to come back; never more than two calls are out."""

import asyncio
import contextlib
import types

from services.rollout.config import RolloutConfig
from services.rollout.workers import LEASE_BATCH, Rollout
from slipstream.v1 import buffer_pb2

CONCURRENCY = 64


class CountingBuffer:
    """Answers LeasePrompts from `available` groups (blocked by staleness when none are left), recording what each
    call asked for."""

    def __init__(self, available: int, answer: asyncio.Event | None = None):
        """`answer`: calls wait for it (a busy buffer), counted in `out` meanwhile."""
        self.available, self.asked, self.served = available, [], 0
        self.answer, self.out, self.most_out = answer, 0, 0

    async def LeasePrompts(self, request, timeout):
        self.asked.append(request.max_groups)
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        if self.answer is not None:
            await self.answer.wait()
        self.out -= 1
        n = min(request.max_groups, self.available)
        self.available -= n
        leases = [buffer_pb2.Lease(lease_id=f"g{self.served + i}#1") for i in range(n)]
        self.served += n
        blocked = buffer_pb2.LEASE_BLOCK_UNSPECIFIED if n else buffer_pb2.LEASE_BLOCK_STALENESS
        return buffer_pb2.LeasePromptsResponse(leases=leases, blocked=blocked)

    async def ReleaseLease(self, request, timeout):  # a stop that finds a lease call out gives its groups back
        return buffer_pb2.ReleaseLeaseResponse()


def rollout_on(buffer: CountingBuffer) -> tuple[Rollout, asyncio.Event, list[str]]:
    """A gateway leasing from `buffer` whose groups hold their slots until `done` is set; `running` lists them."""
    pool = types.SimpleNamespace(running=asyncio.Event(), committed=asyncio.Event(), router=None,
                                 generating=lambda: ["engine"])  # fmt: skip
    pool.running.set()
    rollout = Rollout(RolloutConfig(rollout_concurrency=CONCURRENCY), pool, buffer, reward=None)
    done, running = asyncio.Event(), []

    async def run_group(lease, sampling, n=0):
        running.append(lease.lease_id)
        await done.wait()
        running.remove(lease.lease_id)

    rollout.run_group = run_group
    return rollout, done, running


async def settle(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_gateway_leases_all_its_free_slots_in_one_call_while_groups_are_plentiful():
    buffer = CountingBuffer(available=10_000)
    rollout, done, running = rollout_on(buffer)
    rollout.start()
    await settle(lambda: len(running) == CONCURRENCY)
    # 8, another 8 while the first is out, then doubling with each full answer: 16 + 32
    assert buffer.asked == [LEASE_BATCH, LEASE_BATCH, 2 * LEASE_BATCH, 4 * LEASE_BATCH]
    done.set()  # every group finishes at once: the next call asks for every slot
    await settle(lambda: buffer.served >= 2 * CONCURRENCY)
    await rollout.stop(abort_in_flight=True)
    assert buffer.asked[4] == CONCURRENCY and max(buffer.asked) == CONCURRENCY


async def test_a_gateway_leases_a_few_at_a_time_once_the_buffer_gives_fewer_than_asked():
    buffer = CountingBuffer(available=20)  # a small step's worth, then the staleness bound
    rollout, _done, running = rollout_on(buffer)
    rollout.start()
    await settle(lambda: len(running) == 20 and len(buffer.asked) >= 5)
    assert buffer.asked[:3] == [LEASE_BATCH, LEASE_BATCH, 2 * LEASE_BATCH]  # 8 + 8, then 4 of 16 (short)
    assert buffer.asked[-1] == LEASE_BATCH  # then 8 at a time
    opened = len(buffer.asked)
    buffer.available = 1_000  # the trainer moved on: the next step's groups
    rollout.pool.committed.set()
    await settle(lambda: len(running) == CONCURRENCY)
    await asyncio.sleep(0.1)
    await rollout.stop(abort_in_flight=True)
    assert buffer.asked[opened : opened + 2] == [LEASE_BATCH, LEASE_BATCH]  # it waited in a short call
    assert buffer.served == CONCURRENCY and buffer.available == 1_000 - (CONCURRENCY - 20)  # never more than slots


async def test_a_second_call_goes_out_while_one_is_out_once_half_a_call_of_slots_are_free():
    answer = asyncio.Event()
    buffer = CountingBuffer(available=10_000, answer=answer)
    rollout, _done, running = rollout_on(buffer)
    finish: dict[str, asyncio.Event] = {}

    async def run_group(lease, sampling, n=0):  # each group holds its slot until finish[its lease] is set
        running.append(lease.lease_id)
        await finish.setdefault(lease.lease_id, asyncio.Event()).wait()
        running.remove(lease.lease_id)

    async def free(n: int) -> None:
        for lease_id in list(running)[:n]:
            finish.setdefault(lease_id, asyncio.Event()).set()
        await asyncio.sleep(0.05)

    rollout.run_group = run_group
    rollout.start()
    await settle(lambda: len(buffer.asked) == 2)
    await asyncio.sleep(0.05)
    assert buffer.asked == [LEASE_BATCH, LEASE_BATCH] and buffer.out == 2  # 8, and 8 more while it is out
    answer.set()
    await settle(lambda: len(running) == CONCURRENCY)
    answer.clear()  # a busy buffer: calls take long
    await free(1)
    assert buffer.out == 1 and buffer.asked[-1] == 1  # no call was out: the freed slot goes at once
    await free(CONCURRENCY // 2 - 1)
    assert buffer.out == 1  # 31 free slots wait for the call out: a second needs half of the last full call's 64
    await free(1)
    assert buffer.out == 2 and buffer.asked[-1] == CONCURRENCY // 2
    await free(len(running))
    assert buffer.out == 2  # never a third
    answer.set()
    await rollout.stop(abort_in_flight=True)
    assert buffer.most_out == 2 and max(buffer.asked) <= CONCURRENCY


async def test_a_release_that_a_stop_cancels_lands_before_the_stop_goes_on():
    """Cut short, a release would leave its group leased until the lease expires."""

    class SlowReleases(CountingBuffer):
        async def ReleaseLease(self, request, timeout):
            await asyncio.sleep(0.05)
            self.released.append(request.lease_id)
            return buffer_pb2.ReleaseLeaseResponse()

    buffer = SlowReleases(0)
    buffer.released = []
    rollout, _, _ = rollout_on(buffer)
    releasing = asyncio.create_task(rollout._release("g0#1", "rollout stopped"))
    await asyncio.sleep(0.01)
    releasing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await releasing
    assert releasing.cancelled() and buffer.released == ["g0#1"]
