"""An idle engine's wait for the rest of a burst of requests before its first step (services/engine/core.py): it
ends once requests stop arriving, at its cap while they keep arriving, and at once for a command or a stop. Upper
bounds only, and generous: the benefit (one prefill step for a burst over HTTP) is bench/engine.py's to show."""

import collections
import threading
import time
import types

from services.engine import core


def _idle(waiting=1):
    return types.SimpleNamespace(_wake=threading.Condition(), waiting=collections.deque(range(waiting)),
                                 _stopped=False, _commands=collections.deque())  # fmt: skip


def _gather(engine) -> float:
    started = time.monotonic()
    with engine._wake:
        core.Engine._gather_arrivals(engine)
    return time.monotonic() - started


def test_the_wait_ends_when_requests_stop_arriving():
    assert _gather(_idle()) < 0.5


def test_the_wait_ends_at_its_cap_while_requests_keep_arriving():
    engine, done = _idle(), threading.Event()

    def arrive():
        while not done.is_set():
            with engine._wake:
                engine.waiting.append(0)
                engine._wake.notify()
            time.sleep(0.0001)

    arriving = threading.Thread(target=arrive)
    arriving.start()
    try:
        assert _gather(engine) < core.ARRIVAL_WAIT_S + 0.5
    finally:
        done.set()
        arriving.join()


def test_a_command_or_a_stop_ends_the_wait_at_once():
    for field in ("_commands", "_stopped"):
        engine = _idle()
        setattr(engine, field, collections.deque([1]) if field == "_commands" else True)
        assert _gather(engine) < 0.5
