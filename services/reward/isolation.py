"""Runs verifiers and user reward functions in worker processes, one item per task, each with a deadline.

A verifier that hangs is killed when its deadline passes and its worker replaced; one that raises or crashes its
process costs only its own item. The service keeps serving either way.
"""

import asyncio
import inspect
import multiprocessing
import os
import resource
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pebble import ProcessExpired, ProcessPool

from services.common.plugins import load_callable
from services.common.processes import die_with_parent
from services.reward.verifiers import score_builtin


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
    kind: str  # "timeout", "exception" or "crash"
    message: str


OUT_OF_MEMORY = 75  # the exit code of a worker whose function ran out of its memory limit


def _init_worker(memory_mb: int | None) -> None:
    die_with_parent()
    import math_verify  # noqa: F401 - warm the import so the first item does not pay for it

    if memory_mb is not None:  # after the imports: the limit is the function's room, not the interpreter's
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


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


def run_builtin(rm_type: str, response: str, label: str, metadata: dict) -> Any:
    return score_builtin(rm_type, response, label, metadata)


def run_custom(path: str, args, sample: RewardSample) -> Any:
    return _call(_custom(path), args, sample)


def run_custom_group(path: str, args, samples: list[RewardSample]) -> Any:
    return _call(_custom(path), args, samples)


class WorkerPool:
    def __init__(self, num_workers: int, memory_mb: int | None = None):
        context = multiprocessing.get_context("spawn")  # forking a process that runs gRPC threads is unsafe
        self.memory_mb = memory_mb
        self._pool = ProcessPool(max_workers=num_workers, initializer=_init_worker, initargs=(memory_mb,),
                                 context=context)  # fmt: skip

    async def run(self, timeout_s: float, function, *args) -> Any:
        """`function(*args)` in a worker; a `Failure` instead of raising when it times out, raises, runs out of
        memory or crashes (the pool replaces a worker that timed out, ran out of memory or died)."""
        future = self._pool.schedule(_limited, args=(function, *args), timeout=timeout_s)
        try:
            return await asyncio.wrap_future(future)
        except FutureTimeout:
            return Failure("timeout", f"did not finish within {timeout_s:g}s (raise --rm-timeout-s if it is slow)")
        except ProcessExpired as e:
            if e.exitcode == OUT_OF_MEMORY:
                return Failure("memory", f"needed more than the worker's {self.memory_mb} MiB (raise "
                                         "--reward-worker-memory-mb if it must)")  # fmt: skip
            return Failure("crash", f"the worker process died (exit code {e.exitcode})")
        except Exception as e:  # the reward function's own error, re-raised here by the pool
            return Failure("exception", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)
