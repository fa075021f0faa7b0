"""How a gateway leases: while the buffer has groups to spare, all its free slots in one LeasePrompts call (each call
costs a buffer replica's event loop about as much as the groups it carries, so many small calls from many gateways
are what saturates the buffers); while groups are scarce (a staleness or backpressure bound is near), a few at a
time, so that one gateway does not take a whole small step's prompts from the others. It never leases more groups
than it has free slots."""

import asyncio
import types

from services.rollout.config import RolloutConfig
from services.rollout.workers import LEASE_BATCH, Rollout
from slipstream.v1 import buffer_pb2

CONCURRENCY = 64


class CountingBuffer:
    """Answers LeasePrompts from `available` groups (blocked by staleness when none are left), recording what each
    call asked for."""

    def __init__(self, available: int):
        self.available, self.asked, self.served = available, [], 0

    async def LeasePrompts(self, request, timeout):
        self.asked.append(request.max_groups)
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
    assert buffer.asked == [LEASE_BATCH, 2 * LEASE_BATCH, 4 * LEASE_BATCH, LEASE_BATCH]  # 8 + 16 + 32 + the last 8
    done.set()  # every group finishes at once: the next call asks for every slot
    await settle(lambda: buffer.served >= 2 * CONCURRENCY)
    await rollout.stop(abort_in_flight=True)
    assert buffer.asked[4] == CONCURRENCY and max(buffer.asked) == CONCURRENCY


async def test_a_gateway_leases_a_few_at_a_time_once_the_buffer_gives_fewer_than_asked():
    buffer = CountingBuffer(available=20)  # a small step's worth, then the staleness bound
    rollout, _done, running = rollout_on(buffer)
    rollout.start()
    await settle(lambda: len(running) == 20 and len(buffer.asked) >= 3)
    assert buffer.asked[:3] == [LEASE_BATCH, 2 * LEASE_BATCH, LEASE_BATCH]  # 8, then 12 of 16 (short): 8 again
    opened = len(buffer.asked)
    buffer.available = 1_000  # the trainer moved on: the next step's groups
    rollout.pool.committed.set()
    await settle(lambda: len(running) == CONCURRENCY)
    await asyncio.sleep(0.1)
    await rollout.stop(abort_in_flight=True)
    assert buffer.asked[opened : opened + 2] == [LEASE_BATCH, LEASE_BATCH]  # it waited in a short call
    assert buffer.served == CONCURRENCY and buffer.available == 1_000 - (CONCURRENCY - 20)  # never more than slots
