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
