"""Assembles the buffer service: its Redis (embedded or by URL), datasets, data workers, filters and servicer."""

import asyncio
import contextlib
import multiprocessing
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor

import prometheus_client

from services.buffer.config import BufferConfig
from services.buffer.core import TRAIN, Buffer
from services.buffer.datasets import DatasetError, open_blocks
from services.buffer.prompts import check_rows, eval_row_spec, row_spec
from services.buffer.servicer import BufferServicer
from services.buffer.source import CustomPromptStream, PromptStream, start_data_worker, warm
from services.buffer.store import BufferStore
from services.common.errors import StartupError
from services.common.plugins import PluginError, load_callable
from services.common.redis_connection import open_redis
from services.common.server import Service, Servicer

BUFFER_COUNTS = prometheus_client.Gauge(
    "slipstream_buffer_count", "Buffer counters and sizes as stored in Redis (they survive restarts)", ["name"]
)


def build_streams(config: BufferConfig, executor) -> dict:
    """The train stream and one per eval set; datasets read at start-up have every row checked here."""
    spec = row_spec(config)
    streams: dict = {}
    try:
        if config.data_source_path:
            source_class = load_callable(config.data_source_path, "--data-source-path")
            streams[TRAIN] = CustomPromptStream(source_class(config), spec)
        elif config.prompt_data:
            blocks = open_blocks(config.prompt_data, config.streaming_data)
            shuffle, seed = config.rollout_shuffle, config.rollout_seed
            streams[TRAIN] = PromptStream(TRAIN, blocks, spec, executor, seed, shuffle, config.num_epoch)
        for eval_set in config.eval_sets():
            blocks, own = open_blocks(eval_set.path, False), eval_row_spec(config, eval_set)
            streams[eval_set.name] = PromptStream(eval_set.name, blocks, own, executor, 0, False, None)
        for stream in streams.values():
            if isinstance(stream, PromptStream) and len(stream.blocks) == 1:
                check_rows(stream.rows(0), stream.spec)
    except (DatasetError, PluginError) as e:
        raise StartupError(str(e)) from None
    return streams


async def build(config: BufferConfig) -> Service:
    # On the main thread: the embedded redis-server is tied to the thread that starts it (it exits when that
    # thread's process dies), and a pool thread could end before the service does.
    redis_handle = open_redis(config.redis, config.run_dir)
    client = redis_handle.async_client()
    executor = None
    tokenizers = (config.hf_checkpoint,) if config.hf_checkpoint else ()
    if config.num_data_workers and (config.prompt_data or config.eval_sets()):
        # spawn: forking a process that runs gRPC threads is unsafe.
        context = multiprocessing.get_context("spawn")
        executor = ProcessPoolExecutor(
            config.num_data_workers, mp_context=context, initializer=start_data_worker, initargs=(tokenizers,)
        )
    try:
        streams = await asyncio.to_thread(build_streams, config, executor)
        if streams:
            try:
                await warm(executor, config.num_data_workers, tokenizers)
            except (OSError, ValueError, BrokenExecutor) as e:  # a folder without a tokenizer (in a worker: broken)
                raise StartupError(
                    f"--hf-checkpoint {config.hf_checkpoint}: its tokenizer does not load ({e}); "
                    "pass a Hugging Face model folder with tokenizer files"
                ) from None
        filters = {}
        for name in ("dynamic_sampling_filter_path", "buffer_filter_path"):
            path = getattr(config, name)
            filters[name] = load_callable(path, "--" + name.replace("_", "-")) if path else None
    except (StartupError, PluginError) as e:
        redis_handle.close()
        raise StartupError(str(e)) from None
    store = BufferStore(client, config.redis.prefix, config.run_id)
    buffer = Buffer(config, store, streams, filters["dynamic_sampling_filter_path"], filters["buffer_filter_path"])
    await buffer.start()
    tasks: list[asyncio.Task] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(buffer.expire_forever()))
        tasks.append(asyncio.create_task(buffer.follow_submits()))
        tasks.append(asyncio.create_task(_export_counts(buffer, config.expire_interval_s)))

    async def close() -> None:
        await buffer.close()
        for task in tasks:
            while not task.done():  # a cancel can be lost in a Redis call that ends at that moment (Python 3.11)
                task.cancel()
                await asyncio.wait([task], timeout=1.0)
        if executor is not None:
            executor.shutdown(cancel_futures=True)
        await client.aclose()
        redis_handle.close()

    return Service("buffer", config, [Servicer.of(BufferServicer(buffer))], ready=ready, on_stop=[close])


async def _export_counts(buffer: Buffer, interval_s: float) -> None:
    while True:
        with contextlib.suppress(Exception):
            state = await buffer.state()
            for name, value in {**state.pop("counters"), **state}.items():
                if isinstance(value, int | float):  # not eval_datasets, the sets' names
                    BUFFER_COUNTS.labels(name).set(value)
        await asyncio.sleep(interval_s)
