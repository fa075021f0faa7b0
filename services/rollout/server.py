"""Assembles the rollout gateway: the engine pool (from --engine-urls, then registrations), its health loop, and
the servicer."""

import asyncio
import contextlib

from services.common.clients import Credentials, open_aio_channel
from services.common.errors import StartupError
from services.common.plugins import PluginError
from services.common.server import Service, Servicer
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from services.rollout.launch import launch_engines, launch_router, stop, wait_workers
from services.rollout.servicer import RolloutServicer
from services.rollout.weight_sync import WeightSync
from services.rollout.workers import Rollout
from slipstream.v1 import buffer_pb2_grpc, reward_pb2_grpc


async def build(config: RolloutConfig) -> Service:
    pool = EnginePool(config)
    children = await launch_engines(config) if config.rollout_num_gpus else []
    try:
        if config.use_router:
            children.append(router := await launch_router(config))
            pool.use_router(router.url)
        for url in [*config.engine_urls, *(c.url for c in children if c.name.startswith("engine"))]:
            await pool.register(url)  # an engine that is down now is kept evicted and admitted once it answers
        if config.use_router:
            await wait_workers(router, [e.url for e in pool.healthy()])
        # gRPC channels after the children: forking while gRPC threads run makes gRPC log a warning per child
        # Workers lease, submit and score as `worker`; the weight sync's commit tells the buffer the new version as
        # the trainer whose sync it completes.
        worker, trainer = Credentials.of(config, "worker"), Credentials.of(config, "trainer")
        buffer_channel, reward_channel = (
            open_aio_channel(config.buffer_addr, worker),
            open_aio_channel(config.reward_addr, worker),
        )
        version_channel = open_aio_channel(config.buffer_addr, trainer)
        rollout = Rollout(
            config,
            pool,
            buffer_pb2_grpc.BufferServiceStub(buffer_channel),
            reward_pb2_grpc.RewardServiceStub(reward_channel),
            tokenizer=_tokenizer(config.hf_checkpoint),
        )
    except BaseException as e:
        await stop(children)
        if isinstance(e, PluginError):
            raise StartupError(str(e)) from None
        raise
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
        for channel in (buffer_channel, reward_channel, version_channel):
            await channel.close()
        await stop(children)

    sync = WeightSync(config, pool, buffer_pb2_grpc.BufferServiceStub(version_channel))
    servicer = Servicer.of(RolloutServicer(pool, rollout, sync, config))
    return Service("rollout", config, [servicer], ready=ready, on_stop=[close])


def _tokenizer(path: str):
    if not path:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise StartupError(f"--hf-checkpoint {path}: no tokenizer could be read ({e})") from None
