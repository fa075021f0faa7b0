"""Prompt datasets: JSONL and Parquet files, globs of them, folders written by `datasets`' `save_to_disk`, `path@[a:b]`
row slices of one file, read eagerly or lazily in blocks.

A dataset is a list of blocks. Eagerly read data is one block; with streaming, a JSONL file is cut into byte ranges
at line starts and a Parquet file into its row groups, so the first prompts are ready without reading the whole file.
The epoch order shuffles the blocks, then the rows inside each block, from a seed, so it is the same after a restart.
"""

import glob
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgument

SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
GLOB = re.compile(r"[*?\[]")
STREAM_BLOCK_BYTES = 8 * 1024 * 1024


class DatasetError(InvalidArgument):
    """A dataset file or row that cannot be used; the message names the file, the line and the fix."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.field = "prompt-data"


@dataclass(frozen=True)
class Block:
    """Part of a dataset file: a byte range of a JSONL file, a row range of a Parquet or Arrow file."""

    path: Path
    kind: str  # "jsonl", "parquet" or "arrow" (an Arrow stream file of a saved `datasets` folder)
    start: int  # JSONL: byte offset; Parquet and Arrow: first row (absolute)
    stop: int
    first_line: int | None = None  # JSONL: 0-based line number of `start`, when known


@dataclass(frozen=True)
class RawRow:
    """One row as read, before parsing: the JSON line (bytes) or the Parquet record (dict)."""

    data: bytes | dict
    path: Path
    row: int  # absolute row (0-based line of a JSONL file), or -1 when streaming JSONL has not counted lines
    offset: int = 0  # JSONL: byte offset of the line

    @property
    def where(self) -> str:
        """`data.jsonl line 17` or `data.parquet row 16`, for messages (counts lines only when needed)."""
        if isinstance(self.data, dict):
            return f"{self.path.name} row {self.row}"
        line = self.row if self.row >= 0 else _count_lines(self.path, self.offset)
        return f"{self.path.name} line {line + 1}"


def _count_lines(path: Path, offset: int) -> int:
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(1 << 20, offset))
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def parse_spec(spec: str) -> tuple[Path, int | None, int | None]:
    """`data.jsonl@[10:20]` → (path, 10, 20); no slice → (path, None, None)."""
    match = SLICE.match(spec)
    if not match:
        return Path(spec), None, None
    to_int = lambda text: int(text) if text not in ("", "-") else None  # noqa: E731
    return Path(match["path"]), to_int(match["start"]), to_int(match["stop"])


def file_kind(path: Path) -> str:
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.txt"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")


def dataset_files(path: Path) -> list[tuple[Path, str]]:
    """The files of dataset `path` with their kinds: a JSONL or Parquet file, the files a glob matches (in name
    order), or the Arrow files of a folder written by `datasets`' `save_to_disk` (in its order)."""
    if GLOB.search(str(path)):
        files = sorted(Path(p) for p in glob.glob(str(path.expanduser()), recursive=True) if Path(p).is_file())
        if not files:
            raise DatasetError(f"no file matches {path}; check the pattern given to --prompt-data / --eval-prompt-data")
        return [(file, file_kind(file)) for file in files]
    if path.is_dir():
        return _saved_dataset(path)
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist; pass a .jsonl or .parquet file, a glob of them, or a "
                           "folder written by datasets' save_to_disk")  # fmt: skip
    return [(path, file_kind(path))]


def _saved_dataset(folder: Path) -> list[tuple[Path, str]]:
    state, splits = folder / "state.json", folder / "dataset_dict.json"
    if splits.is_file():
        names = json.loads(splits.read_text()).get("splits", [])
        raise DatasetError(f"{folder} holds the splits {', '.join(names)} of a DatasetDict; name one, e.g. "
                           f"{folder / (names or ['train'])[0]}")  # fmt: skip
    if not state.is_file():
        raise DatasetError(f"{folder} is a folder, but not one written by datasets' save_to_disk (no state.json); "
                           "pass a .jsonl or .parquet file, a glob of them, or such a folder")  # fmt: skip
    return [(folder / entry["filename"], "arrow") for entry in json.loads(state.read_text())["_data_files"]]


def open_blocks(spec: str, streaming: bool, block_bytes: int = STREAM_BLOCK_BYTES) -> list[Block]:
    """The blocks of dataset `spec` (`path` or `path@[a:b]`)."""
    path, start, stop = parse_spec(spec)
    files = dataset_files(path)
    if len(files) > 1 and (start, stop) != (None, None):
        raise DatasetError(f"{spec}: a slice @[a:b] takes one file, and {path} has {len(files)}; slice one of them")
    blocks = []
    for file, kind in files:
        if kind == "parquet":
            blocks += _parquet_blocks(file, start, stop, streaming)
        elif kind == "arrow":
            blocks += _arrow_blocks(file, start, stop)
        else:
            blocks += _jsonl_blocks(file, start, stop, streaming, block_bytes)
    if not blocks:
        raise DatasetError(f"dataset {spec} has no rows; check the file and the @[a:b] slice")
    return blocks


def _arrow_table(path: Path):
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all()


def _arrow_blocks(path: Path, start: int | None, stop: int | None) -> list[Block]:
    lo, hi, _ = slice(start, stop).indices(_arrow_table(path).num_rows)
    return [Block(path, "arrow", lo, hi)] if hi > lo else []


def _parquet_blocks(path: Path, start: int | None, stop: int | None, streaming: bool) -> list[Block]:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    total = metadata.num_rows
    lo, hi, _ = slice(start, stop).indices(total)
    if not streaming:
        return [Block(path, "parquet", lo, hi)] if hi > lo else []
    blocks, offset = [], 0
    for index in range(metadata.num_row_groups):
        size = metadata.row_group(index).num_rows
        a, b = max(lo, offset), min(hi, offset + size)
        if b > a:
            blocks.append(Block(path, "parquet", a, b))
        offset += size
    return blocks


def _jsonl_blocks(path: Path, start: int | None, stop: int | None, streaming: bool, block_bytes: int) -> list[Block]:
    size = path.stat().st_size
    if start is None and stop is None:
        lo, hi, first_line = 0, size, 0
    else:
        if (start or 0) < 0 or (stop or 0) < 0:
            raise DatasetError(f"{path}: negative slice bounds are not supported for JSONL; use @[a:b] with a, b >= 0")
        lo = _line_offset(path, start or 0)
        hi = size if stop is None else _line_offset(path, stop)
        first_line = start or 0
    if hi <= lo:
        return []
    if not streaming:
        return [Block(path, "jsonl", lo, hi, first_line)]
    bounds = [lo]
    with open(path, "rb") as f:
        while bounds[-1] + block_bytes < hi:
            f.seek(bounds[-1] + block_bytes)
            f.readline()  # move to the start of the next line
            if f.tell() >= hi:
                break
            bounds.append(f.tell())
    bounds.append(hi)
    return [Block(path, "jsonl", a, b, first_line if a == lo else None) for a, b in itertools.pairwise(bounds)]


def _line_offset(path: Path, line: int) -> int:
    """Byte offset where 0-based `line` starts (the file size if it has fewer lines); reads only up to it."""
    offset, seen = 0, 0
    with open(path, "rb") as f:
        while seen < line:
            chunk = f.read(1 << 20)
            if not chunk:
                return offset
            count = chunk.count(b"\n")
            if seen + count >= line:
                index = -1
                for _ in range(line - seen):
                    index = chunk.index(b"\n", index + 1)
                return offset + index + 1
            seen += count
            offset += len(chunk)
    return offset


def read_block(block: Block) -> list[RawRow]:
    """The rows of `block`, in file order; blank JSONL lines are skipped."""
    if block.kind in ("parquet", "arrow"):
        if block.kind == "arrow":
            table = _arrow_table(block.path).slice(block.start, block.stop - block.start)
        else:
            table = _read_parquet_rows(block)
        return [RawRow(record, block.path, block.start + i) for i, record in enumerate(table.to_pylist())]
    with open(block.path, "rb") as f:
        f.seek(block.start)
        data = f.read(block.stop - block.start)
    rows, offset = [], block.start
    for i, line in enumerate(data.split(b"\n")):
        if line.strip():
            number = block.first_line + i if block.first_line is not None else -1
            rows.append(RawRow(line, block.path, number, offset))
        offset += len(line) + 1
    return rows


def _read_parquet_rows(block: Block):
    """Only the row groups that overlap the block are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = pq.ParquetFile(block.path)
    groups, offset, first = [], 0, None
    for index in range(file.metadata.num_row_groups):
        size = file.metadata.row_group(index).num_rows
        if offset < block.stop and offset + size > block.start:
            groups.append(index)
            first = offset if first is None else first
        offset += size
    table = file.read_row_groups(groups) if groups else pa.table({})
    return table.slice(block.start - (first or 0), block.stop - block.start)


def epoch_order(count: int, seed: int, epoch: int, salt: int, shuffle: bool) -> np.ndarray:
    """The order in which `count` items are visited in `epoch`; the same for the same arguments, on any machine."""
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng([seed, epoch, salt]).permutation(count)


def parse_json_row(raw: RawRow) -> dict:
    if isinstance(raw.data, dict):
        return raw.data
    try:
        row = json.loads(raw.data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{raw.where}: not valid JSON ({e}); fix the line or pass --skip-invalid-rows") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{raw.where}: a row must be a JSON object, not {type(row).__name__}")
    return row
