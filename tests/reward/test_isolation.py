"""The reward workers' pool when pebble loses track of a worker that died (SIGKILLed between taking an item and
saying so): pebble then marks the whole pool broken and fails every later item. The item in flight is answered as
an error and the next one is scored by a new pool, as the soak found."""

import asyncio
import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool

from services.reward.isolation import WorkerPool


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _break(pool) -> None:
    """What pebble does to its pool on "All workers expired": the status turns to ERROR and its tasks fail."""
    pool._pool_manager.handle_broken_pool(BrokenProcessPool("All workers expired"))


async def test_a_broken_pool_costs_the_item_in_flight_and_the_next_item_gets_a_new_pool():
    pool = WorkerPool(1)
    try:
        assert await pool.run(30, _slow, 0.0) == 0.0
        in_flight = asyncio.create_task(pool.run(30, _slow, 3.0))
        await asyncio.sleep(1.0)
        broken = pool._pool
        _break(broken)
        failure = await in_flight
        assert failure.kind == "crash" and "pool broke" in failure.message
        assert pool._pool is not broken
        assert await pool.run(30, _slow, 0.0) == 0.0
        _break(pool._pool)  # broken between items: the next item goes to a new pool
        assert await pool.run(30, _slow, 0.0) == 0.0
    finally:
        pool.close()


def _pid() -> int:
    return os.getpid()


async def test_a_stopped_worker_costs_its_item_and_the_next_item_is_scored():
    """A worker SIGSTOPped while it holds an item (a hung process, as `make test-faults`' reward-worker-sigstop case
    does it in a whole run): the item fails on its deadline, the worker is stopped for good, and the next item is
    scored."""
    pool = WorkerPool(1)
    try:
        worker = await pool.run(30, _pid)
        in_flight = asyncio.create_task(pool.run(2, _slow, 1.0))
        await asyncio.sleep(0.3)
        os.kill(worker, signal.SIGSTOP)
        failure = await in_flight
        assert failure.kind == "timeout"
        assert await pool.run(30, _slow, 0.0) == 0.0
        assert await pool.run(30, _pid) != worker
    finally:
        pool.close()


def _hang() -> None:
    while True:
        time.sleep(1)


def _refuse() -> None:
    raise ValueError("refused")


async def test_in_a_chunk_an_item_that_hangs_raises_or_crashes_costs_only_itself():
    """A call's items go to a worker together; one that hangs, raises or ends its worker still fails alone, with the
    failure it would have had in a task of its own, and the items after it are scored. (A deadline of 3 s: an item's
    deadline counts from its dispatch to a worker, which may be one just started in place of the hung one; on a
    loaded 2-core machine that start took over a second.)"""
    pool = WorkerPool(1)
    try:
        calls = [(_slow, 0.0), (_hang,), (_slow, 0.1), (_refuse,), (os._exit, 3), (_slow, 0.2)]
        outcomes = await pool.run_many(3.0, calls)
        assert outcomes[0] == 0.0 and outcomes[2] == 0.1 and outcomes[5] == 0.2
        assert outcomes[1].kind == "timeout" and "did not finish within 3s" in outcomes[1].message
        assert outcomes[3].kind == "exception" and outcomes[3].message == "ValueError: refused"
        assert outcomes[4].kind == "crash"
    finally:
        pool.close()


async def test_items_slower_together_than_one_deadline_are_each_scored():
    pool = WorkerPool(1)
    try:
        assert await pool.run_many(1.0, [(_slow, 0.4)] * 4) == [0.4] * 4
    finally:
        pool.close()


class _Counted:
    """The pebble pool with its tasks counted."""

    def __init__(self, pool):
        self.pool, self.tasks = pool, 0

    def schedule(self, *args, **kwargs):
        self.tasks += 1
        return self.pool.schedule(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.pool, name)


async def test_calls_that_come_while_the_workers_are_busy_go_to_the_next_free_one_together():
    """Twenty one-item calls made while the only worker runs a slow item take a few tasks between them, not twenty,
    and each gets its own outcome; an item that hangs among them still fails alone, on its own deadline."""
    pool = WorkerPool(1)
    try:
        assert await pool.run_many(30, [(_slow, 0.0)]) == [0.0]
        counted = pool._pool = _Counted(pool._pool)
        busy = asyncio.create_task(pool.run_many(30, [(_slow, 0.5)]))
        await asyncio.sleep(0.1)  # the worker has it
        outcomes = await asyncio.gather(*(pool.run_many(30, [(_slow, i / 1000)]) for i in range(20)))
        assert outcomes == [[i / 1000] for i in range(20)]
        assert await busy == [0.5]
        assert counted.tasks <= 5, counted.tasks

        busy = asyncio.create_task(pool.run_many(30, [(_slow, 0.5)]))
        await asyncio.sleep(0.1)
        hung, *fast = await asyncio.gather(
            pool.run_many(1.0, [(_hang,)]), *(pool.run_many(1.0, [(_pid,)]) for _ in "ab")
        )
        assert hung[0].kind == "timeout" and all(isinstance(pid, int) for (pid,) in fast)
        assert await busy == [0.5]
        assert pool._busy == 0 and not pool._queued
    finally:
        pool.close()
