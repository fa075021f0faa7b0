"""Assembles the buffer service: its Redis (embedded or by URL) and its servicer."""

import asyncio

from services.buffer.config import BufferConfig
from services.buffer.servicer import BufferServicer
from services.common.redis_connection import open_redis
from services.common.server import Service, Servicer


async def build(config: BufferConfig) -> Service:
    redis_handle = await asyncio.to_thread(open_redis, config.redis, config.run_dir)
    return Service("buffer", config, [Servicer.of(BufferServicer())], on_stop=[redis_handle.close])
