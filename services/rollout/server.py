"""Assembles the rollout gateway: the engine pool (from --engine-urls, then registrations), its health loop, and
the servicer; with --redis-url, its place in the run's fleet of gateways (fleet.py)."""

import asyncio
import contextlib
from pathlib import Path

from services.common.clients import Credentials, open_aio_channel
from services.common.errors import StartupError
from services.common.launch import stop
from services.common.plugins import PluginError
from services.common.redis_connection import open_redis
from services.common.server import Service, Servicer
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool, normalize
from services.rollout.fleet import Fleet, follow, own_address, reconcile
from services.rollout.launch import launch_engines, launch_router, launch_teachers, wait_workers
from services.rollout.servicer import RolloutServicer
from services.rollout.teacher import Teacher
from services.rollout.weight_sync import WeightSync
from services.rollout.workers import Rollout
from slipstream.v1 import buffer_pb2_grpc, reward_pb2_grpc


async def build(config: RolloutConfig) -> Service:
    pool = EnginePool(config)
    fleet, redis_handle = None, None
    failed = asyncio.get_running_loop().create_future()  # what must stop the gateway (rollout.failed)
    if config.redis.url:
        redis_handle = open_redis(config.redis, Path("."))
        me = config.advertise_addr or own_address(config.host, config.port)
        fleet = Fleet(redis_handle.async_client(), config.redis.prefix, config.run_id, me, config.fleet_ttl_s)
        pool.paused_elsewhere = fleet.syncing
    teacher = Teacher(config) if config.use_opd and config.opd_type == "sglang" else None
    children: list = []
    try:
        children = await _children(config, pool, fleet, teacher)
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
            tokenizer=_tokenizer(config),
            redis=fleet.redis if fleet is not None else None,
            failed=failed,
            teacher=teacher,
        )
    except BaseException as e:
        await stop(children)
        if redis_handle is not None:
            redis_handle.close()
        if isinstance(e, PluginError):
            raise StartupError(str(e)) from None
        raise
    tasks: list[asyncio.Task] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(pool.check_forever()))
        if teacher is not None:
            tasks.append(asyncio.create_task(teacher.pool.check_forever()))
        if fleet is not None:  # serving once its share of the engines (or, as the coordinator, every one) is admitted
            await fleet.beat()
            await reconcile(fleet, pool)
            tasks.append(asyncio.create_task(follow(fleet, pool, rollout, config)))

    async def close() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await rollout.stop(abort_in_flight=True)  # unfinished groups go back to the buffer
        await pool.close()
        if teacher is not None:
            await teacher.close()
        for channel in (buffer_channel, reward_channel, version_channel):
            await channel.close()
        await stop(children)
        if fleet is not None:
            with contextlib.suppress(Exception):  # the others take its engines at once, not after its beats expire
                await fleet.leave()
            await fleet.redis.aclose()
            redis_handle.close()

    sync = WeightSync(config, pool, buffer_pb2_grpc.BufferServiceStub(version_channel), fleet)
    servicer = Servicer.of(RolloutServicer(pool, rollout, sync, config, fleet))
    return Service("rollout", config, [servicer], ready=ready, on_stop=[close], finished=failed)


async def _children(config: RolloutConfig, pool: EnginePool, fleet, teacher) -> list:
    """Starts the engines, teachers and router the gateway launches and admits every engine (with a fleet, the
    gateway whose share it is admits it); what it started stops again when any of it fails."""
    children = await launch_engines(config) if config.rollout_num_gpus else []
    try:
        children += await launch_teachers(config)
        if teacher is not None:
            await teacher.register(
                [*config.opd_teacher_urls, *(c.url for c in children if c.name.startswith("teacher"))]
            )
        if config.use_router:
            children.append(router := await launch_router(config))
            pool.use_router(router.url)
        for url in [*config.engine_urls, *(c.url for c in children if c.name.startswith("engine"))]:
            if fleet is not None:
                await fleet.add(normalize(url))
            else:
                await pool.register(url)  # an engine that is down now is kept evicted and admitted once it answers
        if config.use_router:
            await wait_workers(router, [e.url for e in pool.healthy()])
    except BaseException:
        await stop(children)
        raise
    return children


def _tokenizer(config: RolloutConfig):
    """--hf-checkpoint's tokenizer for the generate functions (`ctx.tokenizer`); none when no generate function is
    set, since the built-in path is token-in/token-out and loading one costs seconds of transformers and torch."""
    functions = [config.custom_generate_function_path, *(s.custom_generate_function_path for s in config.eval_sets())]
    path = config.hf_checkpoint
    if not path or not any(functions):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise StartupError(f"--hf-checkpoint {path}: no tokenizer could be read ({e})") from None
