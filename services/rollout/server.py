"""Assembles the rollout gateway: the engine pool (from --engine-urls, then registrations), its health loop, and
the servicer."""

import asyncio
import contextlib

from services.common.server import Service, Servicer
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from services.rollout.servicer import RolloutServicer


async def build(config: RolloutConfig) -> Service:
    pool = EnginePool(config)
    for url in config.engine_urls:
        await pool.register(url)  # an engine that is down now is kept evicted and admitted once it answers
    tasks: list[asyncio.Task] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(pool.check_forever()))

    async def close() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await pool.close()

    return Service("rollout", config, [Servicer.of(RolloutServicer(pool))], ready=ready, on_stop=[close])
