"""What the buffer checks before it serves, run by `slipstream train` (and its `--check`) before any service starts:
every row of the prompt data and of every eval set parses, with the keys the settings name (the whole file, block by
block: a bad row 10,000 rows in stops the run here, not a minute after it started), and the data source and filters
it is given import."""

import dataclasses
import logging

from services.buffer.config import BufferConfig
from services.buffer.datasets import DatasetError, open_blocks, read_block
from services.buffer.prompts import RowSpec, check_rows, eval_row_spec, row_spec
from services.common.config import ConfigError
from services.common.plugins import check_plugins

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20
PLUGINS = ("data_source_path", "dynamic_sampling_filter_path", "buffer_filter_path")


def check(config: BufferConfig) -> None:
    """Raises ConfigError naming the file, the row and the flag to fix."""
    datasets = [("--prompt-data", config.prompt_data, row_spec(config))] if config.prompt_data else []
    source = "--eval-config" if config.eval_config else "--eval-prompt-data"
    datasets += [(source, eval_set.path, eval_row_spec(config, eval_set)) for eval_set in config.eval_sets()]
    for flag, path, spec in datasets:
        try:
            rows = _check_rows(path, spec)
        except DatasetError as e:
            raise ConfigError(f"{flag}: {e}") from None
        log.info("%s %s: %d rows, each valid", flag, path, rows)
    check_plugins({"--" + name.replace("_", "-"): getattr(config, name) for name in PLUGINS})


def _check_rows(path: str, spec: RowSpec) -> int:
    """Checks every row of `path`, a block at a time (each JSONL block told its first line, so that an error names
    the row's line); returns how many rows there are."""
    count, line = 0, 0
    for block in open_blocks(path, streaming=True, block_bytes=BLOCK_BYTES):
        if block.kind == "jsonl":  # a file's first block knows its line; the next ones follow it
            block = dataclasses.replace(block, first_line=line if block.first_line is None else block.first_line)
            line = block.first_line + _newlines(block)
        rows = read_block(block)
        check_rows(rows, spec)
        count += len(rows)
    return count


def _newlines(block) -> int:
    with open(block.path, "rb") as f:
        f.seek(block.start)
        return f.read(block.stop - block.start).count(b"\n")
