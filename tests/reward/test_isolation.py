"""The reward workers' pool: the items of a call go to a worker in one message, and a worker that hangs, is stopped,
is killed or runs out of memory on one of them costs that item only; the items sent with it are scored by the next
worker, each with its own result."""

import asyncio
import os
import signal
import time

from services.reward.isolation import Failure, WorkerPool


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _pid() -> int:
    return os.getpid()


def _die(code: int) -> None:
    os._exit(code)


def _fail(message: str) -> None:
    raise ValueError(message)


def _hog() -> int:
    return len(bytearray(2 << 30))


async def test_each_item_of_a_message_keeps_its_own_result_and_deadline():
    """One worker, one message: an item that hangs fails on its own deadline (not the message's), one that raises or
    crashes its worker fails alone, and every other item, before or after them, gets its own value."""
    pool = WorkerPool(1)
    try:
        calls = [(_slow, 0.0), (_fail, "refused"), (_slow, 0.01), (_slow, 60.0), (_slow, 0.02), (_die, 3),
                 (_slow, 0.03), (_pid,)]  # fmt: skip
        start = time.monotonic()
        results = await pool.run_many(1.0, calls)
        assert time.monotonic() - start < 20
        assert results[0] == 0.0 and results[2] == 0.01 and results[4] == 0.02 and results[6] == 0.03
        assert results[1] == Failure("exception", "ValueError: refused")
        assert results[3].kind == "timeout" and "did not finish within 1s" in results[3].message
        assert results[5] == Failure("crash", "the worker process died (exit code 3)")
        assert isinstance(results[7], int) and await pool.run(30, _pid) == results[7]  # the third worker, kept
    finally:
        await pool.close()


async def test_a_worker_out_of_memory_costs_its_item_and_the_rest_are_scored():
    pool = WorkerPool(1, memory_mb=512)
    try:
        results = await pool.run_many(30, [(_slow, 0.0), (_hog,), (_slow, 0.01)])
        assert results[0] == 0.0 and results[2] == 0.01
        assert results[1].kind == "memory" and "512 MiB" in results[1].message
    finally:
        await pool.close()


async def test_a_killed_worker_costs_its_item_and_the_next_item_gets_a_new_worker():
    """SIGKILLed while it runs an item (as `make test-faults`' reward-worker-sigkill case does it in a whole run)."""
    pool = WorkerPool(1)
    try:
        worker = await pool.run(30, _pid)
        in_flight = asyncio.create_task(pool.run_many(30, [(_slow, 3.0), (_slow, 0.0)]))
        await asyncio.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        failure, after = await in_flight
        assert failure.kind == "crash" and "exit code -9" in failure.message
        assert after == 0.0
        assert await pool.run(30, _pid) != worker
    finally:
        await pool.close()


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
        await pool.close()


async def test_a_cancelled_call_stops_its_worker_and_the_other_calls_are_scored():
    pool = WorkerPool(2)
    try:
        await pool.warm()
        cancelled = asyncio.create_task(pool.run_many(30, [(_slow, 60.0), (_slow, 60.0)]))
        await asyncio.sleep(0.5)
        other = asyncio.create_task(pool.run_many(30, [(_slow, 0.0), (_slow, 0.01)]))
        cancelled.cancel()
        assert await asyncio.wait_for(other, 30) == [0.0, 0.01]
        assert cancelled.cancelled()
    finally:
        await pool.close()
