"""Assembles the rollout gateway: the engine pool (from --engine-urls, then registrations), its health loop, and
the servicer."""

import asyncio
import contextlib

from services.common.clients import open_aio_channel
from services.common.errors import StartupError
from services.common.plugins import PluginError
from services.common.server import Service, Servicer
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from services.rollout.servicer import RolloutServicer
from services.rollout.workers import Rollout
from slipstream.v1 import buffer_pb2_grpc, reward_pb2_grpc


async def build(config: RolloutConfig) -> Service:
    pool = EnginePool(config)
    for url in config.engine_urls:
        await pool.register(url)  # an engine that is down now is kept evicted and admitted once it answers
    buffer_channel, reward_channel = open_aio_channel(config.buffer_addr), open_aio_channel(config.reward_addr)
    try:
        rollout = Rollout(
            config,
            pool,
            buffer_pb2_grpc.BufferServiceStub(buffer_channel),
            reward_pb2_grpc.RewardServiceStub(reward_channel),
            tokenizer=_tokenizer(config.hf_checkpoint),
        )
    except PluginError as e:
        raise StartupError(str(e)) from None
    tasks: list[asyncio.Task] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(pool.check_forever()))

    async def close() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await rollout.stop(abort_in_flight=True)  # unfinished groups go back to the buffer
        await pool.close()
        await buffer_channel.close()
        await reward_channel.close()

    return Service("rollout", config, [Servicer.of(RolloutServicer(pool, rollout))], ready=ready, on_stop=[close])


def _tokenizer(path: str):
    if not path:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise StartupError(f"--hf-checkpoint {path}: no tokenizer could be read ({e})") from None
