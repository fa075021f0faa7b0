"""Runs verifiers and user reward functions in worker processes, each item with a deadline and a memory limit.

A call's items go to the workers a chunk per pebble task (a task costs about as much CPU as a fast verifier's item),
and while every worker has a task, the items of the calls that come meanwhile wait for the first worker to free up and
go to it together, so that under load a task carries many calls' items. An item keeps its own guarantees through a
fallback: a chunk that does not finish in time, or whose worker dies, is run again one item per task. So a verifier
that hangs is killed when its deadline passes and its worker replaced; one that allocates past the limit ends its
worker, which is replaced; one that raises or crashes its process costs only its own item. The service keeps serving
either way.
"""

import asyncio
import contextlib
import importlib
import inspect
import logging
import multiprocessing
import os
import resource
import signal
import time
import traceback
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pebble import ProcessExpired, ProcessPool

from services.common.plugins import load_callable
from services.common.processes import die_with_parent
from services.reward.trl_style import trl_kwargs
from services.reward.verifiers import score_builtin

log = logging.getLogger(__name__)


@dataclass
class RewardSample:
    """What a reward function receives for one item (the fields of slime's Sample that rewards read)."""

    prompt: str
    response: str
    label: str
    metadata: dict = field(default_factory=dict)
    rm_type: str = ""
    item_id: str = ""


@dataclass(frozen=True)
class Failure:
    kind: str  # "timeout", "exception", "memory", "crash" or "invalid"
    message: str
    traceback: str = ""  # the function's, when it raised


TRACEBACK_LINES = 24  # the last lines of a reward function's traceback kept with its failure


def raised(e: Exception, formatted: str) -> Failure:
    """The failure of a function that raised `e` (with `formatted`, its traceback)."""
    lines = formatted.rstrip().splitlines()[-TRACEBACK_LINES:]
    return Failure("exception", f"{type(e).__name__}: {e}", "\n".join(lines))


OUT_OF_MEMORY = 75  # the exit code of a worker whose function ran out of its memory limit


def _init_worker(memory_mb: int | None, custom_path: str | None, imports: tuple[str, ...], started) -> None:
    die_with_parent()
    for module in imports:  # warm the imports so that the first item does not pay for them
        with contextlib.suppress(ImportError):  # a verifier whose library is missing says so on its items
            importlib.import_module(module)

    if custom_path:  # a user's reward module may load a model at import: before the first item, not during it
        with contextlib.suppress(Exception):  # it imported in the service; if not here, its items say why
            _custom(custom_path)
    # After the imports: a limit too low for them fails the first item with a message naming the limit, where a
    # worker that cannot start would only break the pool.
    if memory_mb is not None:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    started.release()


def _limited(function, *args) -> Any:
    """Runs in the worker: a function that ran out of memory ends its worker (the pool starts a fresh one), since
    whatever it left half-allocated would weigh on every later item."""
    try:
        return function(*args)
    except MemoryError:
        os._exit(OUT_OF_MEMORY)


@cache
def _custom(path: str):
    return load_callable(path, "--custom-rm-path")


def _call(function, *args) -> Any:
    result = function(*args)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def run_chunk(calls: list[tuple], budget_s: float) -> list:
    """Runs in a worker: the calls `(function, *args)` in order, until they took `budget_s` (the caller sends the
    rest again); a function's exception is its item's `Failure`, and a MemoryError ends the worker as in `_limited`."""
    outcomes, start = [], time.monotonic()
    for function, *args in calls:
        try:
            outcomes.append(function(*args))
        except MemoryError:
            os._exit(OUT_OF_MEMORY)
        except Exception as e:
            outcomes.append(raised(e, traceback.format_exc()))
        if time.monotonic() - start >= budget_s:
            break
    return outcomes


def run_builtin(rm_type: str, response: str, label: str, metadata: dict) -> Any:
    return score_builtin(rm_type, response, label, metadata)


def run_custom(path: str, args, sample: RewardSample) -> Any:
    return _call(_custom(path), args, sample)


def run_custom_group(path: str, args, samples: list[RewardSample]) -> Any:
    return _call(_custom(path), args, samples)


def run_custom_trl(path: str, samples: list[RewardSample]) -> Any:
    """A reward function written for TRL, on every item of the call at once (services/reward/trl_style.py)."""
    function = _custom(path)
    result = function(**trl_kwargs(samples))
    return asyncio.run(result) if inspect.isawaitable(result) else result


async def together(awaitables: list) -> list:
    """Their results, in order: a lone one awaited as it is (a task for it would cost more than a fast item)."""
    return [await awaitables[0]] if len(awaitables) == 1 else list(await asyncio.gather(*awaitables))


STUCK_GRACE_S = 10.0  # past an item's deadline by this much, the pool itself is stuck (a hung worker holds its lock)
MAX_CHUNK = 64  # items a pool task at most
CHUNK_BUDGET = 0.25  # a chunk's worker takes no further item after this share of an item's deadline


class WorkerPool:
    def __init__(
        self,
        num_workers: int,
        memory_mb: int | None = None,
        custom_path: str | None = None,
        imports: tuple[str, ...] = (),
    ):
        self.num_workers, self.memory_mb, self.custom_path = num_workers, memory_mb, custom_path
        self.imports = imports  # warmed in each worker before its first item
        self._context = multiprocessing.get_context("spawn")  # forking a process that runs gRPC threads is unsafe
        self._started = self._context.Semaphore(0)  # released by each worker once it can take items
        self._pool = self._new_pool()
        self._busy = 0  # chunks given to the workers and not done
        self._queued: list[tuple[float, tuple, asyncio.Future]] = []  # items waiting for a free worker, in order
        self._sending: set[asyncio.Task] = set()

    def _new_pool(self) -> ProcessPool:
        initargs = (self.memory_mb, self.custom_path, self.imports, self._started)
        return ProcessPool(self.num_workers, initializer=_init_worker, initargs=initargs, context=self._context)

    async def warm(self, timeout_s: float = 120.0) -> None:
        """Returns once every worker has started and imported what it runs: seconds on a cold machine, which the
        first items would otherwise wait (the service says it is ready only after this)."""
        deadline = time.monotonic() + timeout_s
        self._pool.schedule(os.getpid)  # pebble starts its workers with the first task
        for started in range(self.num_workers):
            if not await asyncio.to_thread(self._started.acquire, True, max(0.0, deadline - time.monotonic())):
                log.warning(
                    "%d of %d reward workers started within %.0f s; serving with them",
                    started,
                    self.num_workers,
                    timeout_s,
                )
                return

    async def run(self, timeout_s: float, function, *args) -> Any:
        """`function(*args)` in a worker; a `Failure` instead of raising when it times out, raises, runs out of
        memory or crashes (the pool replaces a worker that timed out, ran out of memory or died). A worker that
        hangs outside any item (stopped, or stuck holding the pool's task channel) stalls every item: then the whole
        pool is replaced."""
        pool = self._pool
        try:
            waiting = asyncio.wrap_future(pool.schedule(_limited, args=(function, *args), timeout=timeout_s))
        except RuntimeError:  # the pool broke before (below): the item goes to a new one
            await self._replace(pool)
            pool = self._pool
            waiting = asyncio.wrap_future(pool.schedule(_limited, args=(function, *args), timeout=timeout_s))
        done, _ = await asyncio.wait({waiting}, timeout=timeout_s + STUCK_GRACE_S)
        if not done:
            waiting.cancel()
            await self._replace(pool)
            return Failure(
                "timeout", f"not started within {timeout_s:g}s: a worker hung, and the workers were replaced"
            )
        try:
            return waiting.result()
        except FutureTimeout:
            return Failure("timeout", f"did not finish within {timeout_s:g}s (raise --rm-timeout-s if it is slow)")
        except ProcessExpired as e:
            if e.exitcode == OUT_OF_MEMORY:
                return Failure(
                    "memory",
                    f"needed more than the worker's {self.memory_mb} MiB (raise --reward-worker-memory-mb if it must)",
                )
            return Failure("crash", f"the worker process died (exit code {e.exitcode})")
        except BrokenProcessPool as e:  # pebble lost track of a worker that died (it fails every item from then on)
            await self._replace(pool)
            return Failure("crash", f"the workers' pool broke ({e}); it was replaced")
        except Exception as e:  # the reward function's own error, re-raised here by the pool (with its traceback)
            return raised(e, getattr(e, "traceback", ""))

    async def run_many(self, timeout_s: float, calls: list[tuple]) -> list:
        """Each call `(function, *args)` as `run` would run it, in chunks of a task each, shared among the workers
        (or, while every worker has a chunk, with the other items waiting, in the next chunk a worker takes).
        A chunk's task has the deadline of its last item (its worker starts no item past CHUNK_BUDGET of one item's
        deadline, and that one may take the whole deadline), so only an item at fault makes it fail."""
        if self._busy >= self.num_workers:  # the items join those waiting for the next free worker
            loop = asyncio.get_running_loop()
            waiting = [(timeout_s, call, loop.create_future()) for call in calls]
            self._queued += waiting
            return list(await asyncio.gather(*(future for _, _, future in waiting)))
        size = max(1, min(MAX_CHUNK, -(-len(calls) // self.num_workers)))
        chunks = [calls[i : i + size] for i in range(0, len(calls), size)]
        self._busy += len(chunks)
        try:
            done = await together([self._run_chunk(timeout_s, chunk) for chunk in chunks])
        finally:
            self._busy -= len(chunks)
            self._send_queued()
        return [outcome for outcomes in done for outcome in outcomes]

    def _send_queued(self) -> None:
        """Gives the worker that freed up a share of the waiting items with the first one's deadline, as one chunk."""
        if not self._queued or self._busy >= self.num_workers:
            return
        timeout_s = self._queued[0][0]
        size = max(1, min(MAX_CHUNK, -(-len(self._queued) // self.num_workers)))
        taken, kept = [], []
        for entry in self._queued:
            (taken if entry[0] == timeout_s and len(taken) < size else kept).append(entry)
        self._queued = kept
        self._busy += 1
        task = asyncio.create_task(self._run_queued(timeout_s, taken))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run_queued(self, timeout_s: float, entries: list[tuple[float, tuple, asyncio.Future]]) -> None:
        try:
            outcomes = await self._run_chunk(timeout_s, [call for _, call, _ in entries])
            for (_, _, future), outcome in zip(entries, outcomes, strict=True):
                if not future.done():  # its call may have been cancelled meanwhile
                    future.set_result(outcome)
        finally:
            for _, _, future in entries:
                future.cancel()  # does nothing to a future set above: only a chunk cut short leaves any
            self._busy -= 1
            self._send_queued()

    async def _run_chunk(self, timeout_s: float, calls: list[tuple]) -> list:
        budget_s = CHUNK_BUDGET * timeout_s
        outcomes: list = []
        while len(calls) > 1:
            done = await self.run(timeout_s + budget_s, run_chunk, calls, budget_s)
            if isinstance(done, Failure):  # which item hung, crashed or ran out of memory is for its own task to say
                break
            outcomes += done
            calls = calls[len(done) :]
        return outcomes + await together([self.run(timeout_s, *call) for call in calls])

    async def _replace(self, stuck: ProcessPool) -> None:
        if self._pool is not stuck:  # another item replaced it already
            return
        log.warning("the reward workers' pool is replaced: a worker hung or died where the pool lost track of it")
        self._pool = self._new_pool()
        await asyncio.to_thread(_stop, stuck)

    def close(self) -> None:
        _stop(self._pool)


def _stop(pool: ProcessPool) -> None:
    """Stops a pool's workers, stopped or hung ones too: SIGCONT first, so that they can take pebble's SIGTERM (it
    sends SIGKILL to those that still do not end)."""
    manager = getattr(getattr(pool, "_pool_manager", None), "worker_manager", None)  # pebble's own: its worker pids
    for pid in list(getattr(manager, "workers", {})):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
    pool.stop()
    pool.join(timeout=10)
