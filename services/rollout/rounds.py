"""What the gateway sends in batches (scores: scoring.py; completed groups: submits.py), batched by event-loop round:
nothing waits for a batch to fill. The entries added while the event loop runs one round go out together at the end
of that round (or once the batch is full), so a lone entry is sent at once."""

import asyncio


class RoundBatcher:
    def __init__(self):
        self._waiting: dict[object, list[tuple[object, asyncio.Future]]] = {}  # each key's batch not sent yet
        self._sending: set[asyncio.Task] = set()

    def _add(self, key, entry, full) -> asyncio.Future:
        """Adds `entry` to `key`'s batch, sent at the end of this round or at once when `full(batch)`; the future of
        its result, which `_send` sets."""
        future = asyncio.get_running_loop().create_future()
        batch = self._waiting.setdefault(key, [])
        if not batch:
            asyncio.get_running_loop().call_soon(self._flush, key)
        batch.append((entry, future))
        if full(batch):
            self._flush(key)
        return future

    def _flush(self, key) -> None:
        batch = self._waiting.pop(key, None)
        if batch:
            task = asyncio.create_task(self._send(key, batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, key, batch: list[tuple[object, asyncio.Future]]) -> None:
        """Sends a batch and sets each entry's future (its result, or the error)."""
        raise NotImplementedError
