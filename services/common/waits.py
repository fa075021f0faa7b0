"""Waits on the rollout path that last longer than a second are logged (INFO) with what they waited for.

Nothing there should wait on a timer: with engines that answer at once, a lease, a generation, a score or a submit
takes milliseconds. A line from here points at contention or at a stalled dependency, where silence would hide it.
"""

import contextlib
import logging
import time
from collections.abc import Iterator

SLOW_S = 1.0


@contextlib.contextmanager
def logged_wait(log: logging.Logger, what: str, *args) -> Iterator[list[str]]:
    """Times the block; past SLOW_S, logs `what % args`, the seconds waited and the notes the block appended to the
    list it is given (why it waited: the buffer's answers, retries, ...)."""
    notes: list[str] = []
    start = time.monotonic()
    try:
        yield notes
    finally:
        waited = time.monotonic() - start
        if waited > SLOW_S:
            why = f" ({'; '.join(notes)})" if notes else ""
            log.info("waited %.1f s for " + what + why, waited, *args)
