"""The stream of new prompt groups in epoch order, tokenized ahead of demand.

Positions are cursors (epoch, block position, row position) that the store keeps in Redis, so after a restart the
stream resumes exactly where the last committed lease left it. Tokenization runs in data worker processes, a few
chunks ahead of the leases, so a lease rarely waits for the tokenizer and never for the whole file. The buffer
processes of a run share what they tokenized (services/buffer/prepared.py): each chunk is tokenized by one of them.
"""

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from services.buffer.datasets import Block, RawRow, epoch_order, read_block
from services.buffer.prepared import SharedChunks
from services.buffer.prompts import RowSpec, Skipped, load_tokenizer, prepare_rows
from services.common.processes import die_with_parent

# Without data workers, tokenization runs on one thread: one tokenizer object is not safe to share across threads.
_TOKENIZE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


def load_tokenizers(paths: tuple[str, ...]) -> None:
    for path in paths:
        load_tokenizer(path)


def start_data_worker(tokenizer_paths: tuple[str, ...]) -> None:
    """A data worker's initializer: it dies with the service, and has its tokenizers before it takes a chunk."""
    die_with_parent()
    load_tokenizers(tokenizer_paths)


async def warm(executor: Executor | None, num_workers: int, tokenizer_paths: tuple[str, ...]) -> None:
    """Starts the data workers (or the tokenizing thread) and loads their tokenizers before the service says it is
    ready: loading one is seconds on a cold machine (transformers' imports), which the first leases would wait."""
    loop = asyncio.get_running_loop()
    if executor is None:
        await loop.run_in_executor(_TOKENIZE_THREAD, load_tokenizers, tokenizer_paths)
        return
    # Submitted together, the calls start every worker; each loads the tokenizers before it takes a call.
    await asyncio.gather(*(loop.run_in_executor(executor, load_tokenizers, ()) for _ in range(num_workers)))


@dataclass(frozen=True, order=True)
class Cursor:
    epoch: int = 0
    block: int = 0  # position in the epoch's block order
    row: int = 0  # position in that block's row order

    def encode(self) -> str:
        return f"{self.epoch}:{self.block}:{self.row}"

    @classmethod
    def decode(cls, text: str | bytes | None) -> "Cursor":
        if not text:
            return cls()
        epoch, block, row = (int(part) for part in (text.decode() if isinstance(text, bytes) else text).split(":"))
        return cls(epoch, block, row)


@dataclass(frozen=True)
class Item:
    """One position of the stream: the group it yields (serialized PromptGroup without samples) or why it yields
    none, and the cursor after it."""

    group_id: str
    payload: bytes | Skipped
    after: Cursor
    ends_chunk: str = ""  # the chunk this item is the last of (leasing it finishes the chunk)


# The most new groups made ahead into a dataset's ready list at a time (and the most that wait there before the next
# read-ahead starts): about a tenth of a second of leases at 10,000 groups/s, the rate of eight gateways in
# bench/scale.py, so a read-ahead finishes before the list runs dry. A stream starts at a chunk's worth and doubles
# its read-ahead each time a lease finds the list empty, so a slow run does not read far ahead.
READ_AHEAD = 1024


class PromptStream:
    """Epoch-ordered prompt groups of one dataset, starting at a cursor."""

    def __init__(
        self,
        name: str,
        blocks: list[Block],
        spec: RowSpec,
        executor: Executor | None,
        seed: int,
        shuffle: bool,
        num_epoch: int | None,
        chunk_rows: int = 32,
        chunks_ahead: int = 8,
    ):
        self.name, self.blocks, self.spec, self.executor = name, blocks, spec, executor
        self.seed, self.shuffle, self.num_epoch = seed, shuffle, num_epoch
        self.chunk_rows, self.chunks_ahead = chunk_rows, chunks_ahead
        self.read_ahead, self.max_read_ahead = chunk_rows, READ_AHEAD
        self._items: AsyncIterator[list[Item]] | None = None
        self._next: collections.deque[Item] = collections.deque()  # the items made and not taken, in order
        self._cursor = Cursor()
        # A dataset read eagerly is one block: keep its rows instead of reading the file again every epoch.
        self._rows_cache: dict[int, list[RawRow]] = {}
        self._shared: SharedChunks | None = None

    def read_more(self) -> None:
        """A lease found no group made ahead: read twice as far ahead from now on."""
        self.read_ahead = min(2 * self.read_ahead, self.max_read_ahead)

    def share(self, redis, prefix: str) -> None:
        """Shares tokenized chunks with the run's other buffer processes under `prefix`, in a part of it that only
        processes that turn rows into the same prompts share."""
        how = repr((self.blocks, self.spec, self.seed, self.shuffle, self.chunk_rows)).encode()
        self._shared = SharedChunks(redis, f"{prefix}:{self.name}:{hashlib.sha256(how).hexdigest()[:16]}")

    async def forget(self, items: list[Item]) -> None:
        """Called once `items` are leased: the chunks they finish are needed by no process any more."""
        if self._shared is not None:
            await self._shared.forget({item.ends_chunk for item in items if item.ends_chunk})

    def rows(self, block_index: int) -> list[RawRow]:
        if block_index in self._rows_cache:
            return self._rows_cache[block_index]
        rows = read_block(self.blocks[block_index])
        if len(self.blocks) == 1:
            self._rows_cache[block_index] = rows
        return rows

    def reset(self, cursor: Cursor) -> None:
        """Restart at `cursor` (after a restart, or when a lease was not committed)."""
        self._items, self._cursor, self._next = None, cursor, collections.deque()

    async def seek(self, cursor: Cursor) -> None:
        """Continue at `cursor`, the stored one. Ahead of this stream's position (another buffer process leased the
        prompts in between), the items tokenized ahead are skipped up to it; behind (a lease was not stored), or
        farther ahead than this stream read, it restarts there."""
        if cursor == self._cursor:
            return
        if self._items is not None and self._cursor < cursor:
            for _ in range(self.chunk_rows * self.chunks_ahead):
                item = await self._peek()
                if item is None or item.after > cursor:
                    break
                self._cursor = self._next.popleft().after
                if item.after == cursor:
                    return
        self.reset(cursor)

    async def take(self, num_groups: int) -> list[Item]:
        """Items up to and including the `num_groups`-th group (skipped rows in between come along); fewer at the
        end of the last epoch."""
        taken, groups = [], 0
        while groups < num_groups and await self._peek() is not None:
            item = self._next.popleft()
            taken.append(item)
            groups += not isinstance(item.payload, Skipped)
        if taken:
            self._cursor = taken[-1].after
        return taken

    async def _peek(self) -> Item | None:
        """The next item (a chunk's items are made at once), or None at the end of the last epoch."""
        if not self._next:
            if self._items is None:
                self._items = self._generate(self._cursor)
            with contextlib.suppress(StopAsyncIteration):  # with a default, 3.11's anext turns errors into SystemError
                self._next.extend(await anext(self._items))
            await asyncio.sleep(0)  # a read-ahead of many chunks lets the process's other calls run between them
        return self._next[0] if self._next else None

    async def _generate(self, cursor: Cursor) -> AsyncIterator[list[Item]]:
        """Each chunk's items from `cursor` on, tokenized `chunks_ahead` chunks ahead."""
        in_flight: collections.deque = collections.deque()
        for chunk_id, chunk in self._chunks(cursor):
            in_flight.append((chunk_id, chunk, self._prepare(chunk_id, chunk)))
            if len(in_flight) >= self.chunks_ahead and (items := await self._finish(in_flight.popleft(), cursor)):
                yield items
        while in_flight:
            if items := await self._finish(in_flight.popleft(), cursor):
                yield items

    def _prepare(self, chunk_id: str, chunk: list[tuple[RawRow, str, Cursor]]) -> asyncio.Future:
        rows = [raw for raw, _, _ in chunk]
        loop = asyncio.get_running_loop()

        def tokenize() -> asyncio.Future:
            return loop.run_in_executor(self.executor or _TOKENIZE_THREAD, prepare_rows, rows, self.spec)

        if self._shared is None:
            return tokenize()
        return asyncio.ensure_future(self._shared.prepare(chunk_id, tokenize))

    async def _finish(self, entry, start: Cursor) -> list[Item]:
        """The chunk's items from `start` on (a stream that starts inside a chunk prepares all of it, for sharing)."""
        chunk_id, chunk, future = entry
        payloads = await future
        last = len(chunk) - 1
        items = [
            Item(group_id, payload, after, chunk_id if k == last else "")
            for k, ((_, group_id, after), payload) in enumerate(zip(chunk, payloads, strict=True))
        ]
        return items if chunk[0][2] > start else [item for item in items if item.after > start]

    def _chunks(self, cursor: Cursor):
        """Chunks of (row, group id, cursor after it), from the one that holds `cursor` to the end of the last epoch,
        each with its id: chunks are `chunk_rows` row positions of one block, the same for every process.

        Reading a block is synchronous file I/O: streaming blocks are a few MiB, and an eagerly read dataset is read
        once at start-up (`rows`) and cached."""
        epoch, block_pos, row_pos = cursor.epoch, cursor.block, cursor.row
        while self.num_epoch is None or epoch < self.num_epoch:
            block_order = epoch_order(len(self.blocks), self.seed, epoch, 0, self.shuffle)
            while block_pos < len(self.blocks):
                yield from self._block_chunks(epoch, block_pos, int(block_order[block_pos]), row_pos)
                block_pos, row_pos = block_pos + 1, 0
            epoch, block_pos = epoch + 1, 0

    def _block_chunks(self, epoch: int, block_pos: int, block_index: int, row_pos: int):
        rows = self.rows(block_index)
        row_order = epoch_order(len(rows), self.seed, epoch, block_index + 1, self.shuffle)
        for first in range(row_pos - row_pos % self.chunk_rows, len(rows), self.chunk_rows):
            chunk = []
            for pos in range(first, min(first + self.chunk_rows, len(rows))):
                row_index = int(row_order[pos])
                after = Cursor(epoch, block_pos, pos + 1) if pos + 1 < len(rows) else Cursor(epoch, block_pos + 1)
                chunk.append((rows[row_index], f"{self.name}:e{epoch}:b{block_index}:r{row_index}", after))
            yield f"{epoch}:{block_pos}:{first // self.chunk_rows}", chunk


class CustomPromptStream:
    """New groups from a user's prompt source with slime's contract: `get_samples(num_samples)` returns groups, each
    a list of samples (objects with `prompt`, `label`, `metadata`, or dicts with those keys); the first sample of a
    group gives its prompt. Its position is counted in Redis like a dataset's (block 0, row = groups taken).

    The source object lives in one buffer process, which cannot skip what another one's source handed out: a run
    with a custom source has one buffer process (docs/buffer.md)."""

    read_ahead = 0  # the source is asked for groups only when a lease needs them, as slime asks it

    def read_more(self) -> None:
        """Still only what a lease needs."""

    def __init__(self, source, spec: RowSpec, name: str = "train"):
        self.source, self.spec, self.name = source, spec, name
        self._cursor = Cursor()

    def reset(self, cursor: Cursor) -> None:
        self._cursor = cursor

    async def seek(self, cursor: Cursor) -> None:
        self._cursor = cursor

    async def forget(self, items: list[Item]) -> None:
        """Nothing is shared: the source lives in one process."""

    async def take(self, num_groups: int) -> list[Item]:
        groups = await asyncio.to_thread(self.source.get_samples, num_groups)
        rows = []
        for offset, group in enumerate(groups or []):
            first = group[0] if isinstance(group, list | tuple) else group
            get = first.get if isinstance(first, dict) else lambda key, f=first: getattr(f, key, None)
            row = {self.spec.input_key: get("prompt"), self.spec.metadata_key: get("metadata"), "label": get("label")}
            rows.append(RawRow(row, Path("--data-source-path"), self._cursor.row + offset))
        has_labels = any(raw.data["label"] is not None for raw in rows)
        spec = replace(self.spec, label_key="label" if has_labels else None)
        payloads = await asyncio.get_running_loop().run_in_executor(_TOKENIZE_THREAD, prepare_rows, rows, spec)
        items = []
        for raw, payload in zip(rows, payloads, strict=True):
            self._cursor = Cursor(0, 0, raw.row + 1)
            items.append(Item(f"{self.name}:custom:r{raw.row}", payload, self._cursor))
        return items
