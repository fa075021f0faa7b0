"""Runs verifiers and user reward functions in worker processes, each item with a deadline and a memory limit.

The items of a Score call go to a worker in one message and their results come back one by one, so that each item
keeps its own deadline: a verifier that hangs is killed when its deadline passes and its worker replaced; one that
allocates past the limit ends its worker, which is replaced; one that raises or crashes its process costs only its
own item. The items sent with it that had not run yet go to the next worker. The service keeps serving either way.
"""

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import os
import pickle
import resource
import signal
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from services.common.plugins import load_callable
from services.common.processes import die_with_parent
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
    kind: str  # "timeout", "memory", "exception", "crash" or "invalid"
    message: str


OUT_OF_MEMORY = 75  # the exit code of a worker whose function ran out of its memory limit
MAX_ITEMS_A_MESSAGE = 64  # a worker's share of a large call goes in messages of at most this many items
FRAME = struct.Struct("!Q")  # the length that comes before each message, either way
READ_SIZE = 1 << 18
INLINE_SEND = 1 << 16  # larger messages to a worker are written from a thread (a pipe holds 64 KiB at least)
RESTART_DELAY_S = 1.0  # a worker that died while starting is started again after this long, not in a tight loop


def _init_worker(memory_mb: int | None, custom_path: str | None) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the service's to handle
    import math_verify  # noqa: F401 - warm the import so the first item does not pay for it

    if custom_path:  # a user's reward module may load a model at import: before the first item, not during it
        with contextlib.suppress(Exception):  # it imported in the service; if not here, its items say why
            _custom(custom_path)
    # After the imports: a limit too low for them fails the first item with a message naming the limit, where a
    # worker that cannot start would only be started again and again.
    if memory_mb is not None:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _serve(conn, memory_mb: int | None, custom_path: str | None) -> None:
    """A worker's life: an empty frame once it can take items, then for each frame of pickled calls, one frame per
    call, in order, with (True, value) or (False, "ExceptionType: message") pickled."""
    _init_worker(memory_mb, custom_path)
    fd = conn.fileno()
    _write_frame(fd, b"")
    while True:
        try:
            calls = pickle.loads(_read_frame(fd))
        except EOFError:  # the service closed its end: it is stopping
            return
        for function, *args in calls:
            _write_frame(fd, _outcome(function, args))


def _write_frame(fd: int, data: bytes) -> None:
    """A length, then the bytes (the reader takes in what one read brings and splits it, where multiprocessing's
    `recv_bytes` takes a poll and two reads a message)."""
    view = memoryview(FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_frame(fd: int) -> bytes:
    (size,) = FRAME.unpack(_read_exactly(fd, FRAME.size))
    return _read_exactly(fd, size)


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, READ_SIZE))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_copy(fd: int, data: bytes) -> None:
    """Writes a large message in a thread, on its own copy of the descriptor: a worker stopped before it reads it all
    must not stall the service, and the service may close its own descriptor (and reuse the number) meanwhile."""
    with contextlib.suppress(OSError):  # the worker was killed first
        _write_frame(fd, data)
    os.close(fd)


def _outcome(function, args) -> bytes:
    """Runs in the worker: a function that ran out of memory ends its worker (a fresh one is started), since
    whatever it left half-allocated would weigh on every later item."""
    try:
        outcome = (True, function(*args))
    except MemoryError:
        os._exit(OUT_OF_MEMORY)
    except BaseException as e:  # the reward function's own error, SystemExit included: it costs only its item
        outcome = (False, f"{type(e).__name__}: {e}")
    try:
        return pickle.dumps(outcome, pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return pickle.dumps((False, f"{type(e).__name__}: the result could not be sent back: {e}"))


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


@dataclass(eq=False)
class _Item:
    call: tuple  # (function, *args)
    timeout_s: float
    future: asyncio.Future


@dataclass(eq=False)
class _Worker:
    """A worker process and the service's end of its pipe. `items` were sent to it and are not answered yet: the
    first one runs since `started_at`."""

    process: Any
    conn: Any
    ready: asyncio.Future
    items: deque = field(default_factory=deque)
    started_at: float = 0.0
    received: bytearray = field(default_factory=bytearray)  # read, not yet a whole frame
    timer: asyncio.TimerHandle | None = None


class WorkerPool:
    def __init__(self, num_workers: int, memory_mb: int | None = None, custom_path: str | None = None):
        self.num_workers, self.memory_mb, self.custom_path = num_workers, memory_mb, custom_path
        self._context = multiprocessing.get_context("spawn")  # forking a process that runs gRPC threads is unsafe
        self._workers: list[_Worker] = []
        self._queue: deque[_Item] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _start_workers(self) -> None:
        if self._loop is None:  # on first use, in the service's event loop, which reads the workers' pipes
            self._loop = asyncio.get_running_loop()
            for _ in range(self.num_workers):
                self._start_worker()

    def _start_worker(self) -> None:
        if self._closed:
            return
        conn, child = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child, self.memory_mb, self.custom_path), daemon=False)
        process.start()
        child.close()
        worker = _Worker(process, conn, self._loop.create_future())
        self._workers.append(worker)
        self._loop.add_reader(conn.fileno(), self._readable, worker)

    async def warm(self, timeout_s: float = 120.0) -> None:
        """Returns once every worker has started and imported what it runs: seconds on a cold machine, which the
        first items would otherwise wait (the service says it is ready only after this)."""
        self._start_workers()
        _, waiting = await asyncio.wait([asyncio.shield(w.ready) for w in self._workers], timeout=timeout_s)
        if waiting:
            log.warning("%d of %d reward workers started within %.0f s; serving with them",
                        self.num_workers - len(waiting), self.num_workers, timeout_s)  # fmt: skip
            for shielded in waiting:
                shielded.cancel()

    async def run(self, timeout_s: float, function, *args) -> Any:
        """`function(*args)` in a worker: what it returned, or a `Failure` (see `run_many`)."""
        return (await self.run_many(timeout_s, [(function, *args)]))[0]

    async def run_many(self, timeout_s: float, calls: list[tuple]) -> list[Any]:
        """`function(*args)` in a worker for each `(function, *args)` of `calls`, each with its own deadline: what
        each returned, or a `Failure` where it timed out, raised, ran out of memory or crashed its worker. A call
        cancelled while its items run stops the workers that hold them (started again at once)."""
        if not calls:
            return []
        self._start_workers()
        items = [_Item(call, timeout_s, self._loop.create_future()) for call in calls]
        self._queue.extend(items)
        self._dispatch()
        try:
            return await asyncio.gather(*(item.future for item in items))
        except asyncio.CancelledError:
            self._cancel(items)
            raise

    def _dispatch(self) -> None:
        """Gives the queued items to the idle workers, a message each (spread over them all where there are several)."""
        idle = [w for w in self._workers if w.ready.done() and not w.items]
        for i, worker in enumerate(idle):
            while self._queue and self._queue[0].future.done():  # cancelled
                self._queue.popleft()
            if not self._queue:
                return
            size = min(MAX_ITEMS_A_MESSAGE, -(-len(self._queue) // (len(idle) - i)))
            self._send(worker, [self._queue.popleft() for _ in range(min(size, len(self._queue)))])

    def _send(self, worker: _Worker, items: list[_Item]) -> None:
        try:
            message = pickle.dumps([item.call for item in items], pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # an argument that cannot be pickled: its message cannot be sent at all
            for item in items:
                _settle(item, Failure("exception", f"{type(e).__name__}: {e}"))
            return
        worker.items.extend(items)
        self._began(worker)
        if len(message) > INLINE_SEND:
            self._loop.run_in_executor(None, _send_copy, os.dup(worker.conn.fileno()), message)
            return
        # An idle worker has read all it was sent, so that this fits the pipe's buffer. One that died says so next on
        # its end of the pipe, and its items go to the next worker.
        with contextlib.suppress(OSError):
            _write_frame(worker.conn.fileno(), message)

    def _began(self, worker: _Worker) -> None:
        """The first of the worker's items starts now: its deadline is checked by one timer per worker, moved on only
        when it fires (cheaper than a timer per item)."""
        worker.started_at = self._loop.time()
        deadline = worker.started_at + worker.items[0].timeout_s
        if worker.timer is not None and worker.timer.when() > deadline:  # set for a longer deadline than this one
            worker.timer.cancel()
            worker.timer = None
        if worker.timer is None:
            worker.timer = self._loop.call_at(deadline, self._check, worker)

    def _check(self, worker: _Worker) -> None:
        worker.timer = None
        if not worker.items or worker not in self._workers:
            return
        item = worker.items[0]
        deadline = worker.started_at + item.timeout_s
        if self._loop.time() < deadline:
            worker.timer = self._loop.call_at(deadline, self._check, worker)
            return
        worker.items.popleft()
        _settle(item, Failure("timeout", f"did not finish within {item.timeout_s:g}s (raise --rm-timeout-s if it "
                                         "is slow)"))  # fmt: skip
        self._replace(worker)
        self._dispatch()

    def _replace(self, worker: _Worker) -> None:
        """Kills a worker (hung, or running a cancelled item) and starts another; its unanswered items are queued."""
        self._retire(worker)
        _kill(worker.process)
        self._loop.run_in_executor(None, worker.process.join, 10.0)  # reaps it once it has ended
        self._start_worker()

    def _readable(self, worker: _Worker) -> None:
        try:
            data = os.read(worker.conn.fileno(), READ_SIZE)
        except OSError:
            data = b""
        if not data:  # its process ended
            self._lost(worker)
            self._dispatch()
            return
        worker.received += data
        start = 0
        while len(worker.received) - start >= FRAME.size:
            (size,) = FRAME.unpack_from(worker.received, start)
            if len(worker.received) - start - FRAME.size < size:
                break
            start += FRAME.size + size
            self._answered(worker, worker.received[start - size : start])
        del worker.received[:start]
        self._dispatch()

    def _answered(self, worker: _Worker, frame: bytearray) -> None:
        if not worker.ready.done():
            worker.ready.set_result(None)
            return
        item = worker.items.popleft()
        try:
            ok, value = pickle.loads(frame)
        except Exception as e:  # a value whose class the service cannot import
            ok, value = False, f"{type(e).__name__}: the result could not be read: {e}"
        _settle(item, value if ok else Failure("exception", value))
        if worker.items:
            self._began(worker)

    def _lost(self, worker: _Worker) -> None:
        """Its process ended on its own: its item in hand fails (out of memory, or a crash), the others are sent on."""
        item = worker.items.popleft() if worker.items else None
        self._retire(worker)
        worker.process.join(1.0)  # it has closed its pipe: it is exiting
        code = worker.process.exitcode
        if item is not None:
            if code == OUT_OF_MEMORY:
                _settle(item, Failure("memory", f"needed more than the worker's {self.memory_mb} MiB (raise "
                                                "--reward-worker-memory-mb if it must)"))  # fmt: skip
            else:
                _settle(item, Failure("crash", f"the worker process died (exit code {code})"))
        if code is None:
            _kill(worker.process)
        if worker.ready.done():
            self._start_worker()
        else:
            log.warning("a reward worker exited while starting (exit code %s); starting another in %g s", code,
                        RESTART_DELAY_S)  # fmt: skip
            worker.ready.cancel()
            self._loop.call_later(RESTART_DELAY_S, self._start_worker)

    def _retire(self, worker: _Worker) -> None:
        """Stops reading a worker; the items it was sent and had not answered go back to the front of the queue."""
        self._workers.remove(worker)
        self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        if worker.timer is not None:
            worker.timer.cancel()
        self._queue.extendleft(reversed(worker.items))
        worker.items.clear()

    def _cancel(self, items: list[_Item]) -> None:
        cancelled = {id(item) for item in items}
        for item in items:
            item.future.cancel()
        for worker in list(self._workers):
            if any(id(item) in cancelled for item in worker.items):
                self._replace(worker)
        self._dispatch()

    async def close(self) -> None:
        self._closed = True
        workers, self._workers = self._workers, []
        for worker in workers:
            if self._loop is not None:
                self._loop.remove_reader(worker.conn.fileno())
            worker.conn.close()
            for item in worker.items:
                _settle(item, Failure("crash", "the reward service is stopping"))
        for item in self._queue:
            _settle(item, Failure("crash", "the reward service is stopping"))
        self._queue.clear()
        await asyncio.to_thread(_stop, [w.process for w in workers])


def _settle(item: _Item, outcome: Any) -> None:
    if not item.future.done():  # not cancelled
        item.future.set_result(outcome)


def _kill(process) -> None:
    with contextlib.suppress(OSError):
        os.kill(process.pid, signal.SIGKILL)  # a stopped process ends too


def _stop(processes: list) -> None:
    """Stops the workers, stopped or hung ones too: SIGCONT first, so that they can take SIGTERM; SIGKILL for those
    that still have not ended after a while."""
    for process in processes:
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
    deadline = time.monotonic() + 10
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            _kill(process)
            process.join(1.0)
