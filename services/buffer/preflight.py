"""What the buffer checks before it serves, run as well by `slipstream train` (and its `--check`) before any service
starts, in a second or two whatever the data's size: the first rows of the prompt data and of every eval set parse,
with the keys the settings name, and the data source and filters it is given import."""

from services.buffer.config import BufferConfig
from services.buffer.datasets import DatasetError, open_blocks, read_block
from services.buffer.prompts import RowSpec, check_rows, eval_row_spec, row_spec
from services.common.config import ConfigError
from services.common.plugins import check_plugins

ROWS = 100  # the rows of each file read here; the buffer checks all of them at start when it reads them whole
BLOCK_BYTES = 1 << 20
PLUGINS = ("data_source_path", "dynamic_sampling_filter_path", "buffer_filter_path")


def check(config: BufferConfig) -> None:
    """Raises ConfigError naming the file, the row and the flag to fix."""
    datasets = [("--prompt-data", config.prompt_data, row_spec(config))] if config.prompt_data else []
    source = "--eval-config" if config.eval_config else "--eval-prompt-data"
    datasets += [(source, eval_set.path, eval_row_spec(config, eval_set)) for eval_set in config.eval_sets()]
    for flag, path, spec in datasets:
        try:
            _check_rows(path, spec)
        except DatasetError as e:
            raise ConfigError(f"{flag}: {e}") from None
    check_plugins({"--" + name.replace("_", "-"): getattr(config, name) for name in PLUGINS})


def _check_rows(path: str, spec: RowSpec) -> None:
    rows = read_block(open_blocks(path, streaming=True, block_bytes=BLOCK_BYTES)[0])
    check_rows(rows[:ROWS], spec)
