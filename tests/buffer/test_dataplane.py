"""The buffer's data plane as a declared, versioned layout (services/buffer/dataplane.py): the buffer writes its layout
version into the run's keys, and a buffer, a gateway or a trainer that finds another one stops with one sentence."""

import asyncio

import pytest

from services.buffer import dataplane
from services.rollout.config import RolloutConfig
from services.rollout.workers import Rollout
from slipstream.v1 import buffer_pb2
from tests.buffer.conftest import finish
from tests.redis_servers import async_client

MISMATCH = (
    r"the buffer's Redis holds data-plane layout 999 under \S+ and this slipstream reads layout "
    rf"{dataplane.LAYOUT_VERSION}: run the buffer, the gateways and the trainer from the same slipstream version$"
)


async def test_a_buffer_declares_its_layout_and_refuses_a_run_of_another(make_buffer):
    buffer = await make_buffer()
    layout = dataplane.layout_key(buffer.store.ns)
    assert await buffer.store.redis.get(layout) == str(dataplane.LAYOUT_VERSION).encode()
    await make_buffer(run_id=buffer.config.run_id)  # the same run, restarted
    await buffer.store.redis.set(layout, 999)
    with pytest.raises(dataplane.LayoutMismatch, match=MISMATCH):
        await make_buffer(run_id=buffer.config.run_id)


async def test_a_reader_of_another_layout_stops_with_one_sentence(make_buffer, redis_url):
    """The trainer's check (a synchronous client, the namespace from the keys GetBatch hands out) and the gateway's."""
    buffer = await make_buffer()
    key = buffer.store.arrays_keys(["train:e0:b0:r1"])[0]
    assert dataplane.namespace_of(key) == buffer.store.ns
    client = async_client(redis_url)
    try:
        plane = dataplane.DataPlane(client, dataplane.namespace_of(key))
        await plane.check_layout()
        await client.set(dataplane.layout_key(plane.ns), 999)
        with pytest.raises(dataplane.LayoutMismatch, match=MISMATCH):
            await plane.check_layout()
        with pytest.raises(dataplane.LayoutMismatch, match=MISMATCH):
            dataplane.check_layout(plane.ns, await client.get(dataplane.layout_key(plane.ns)))
        with pytest.raises(dataplane.LayoutMismatch, match=r"^Redis holds no data-plane layout under \S+ and this"):
            await dataplane.DataPlane(client, "elsewhere:{run}").check_layout()
    finally:
        await client.aclose()


async def test_a_gateway_that_finds_another_layout_completes_nothing_and_stops(make_buffer, redis_url):
    buffer = await make_buffer()
    (leased,) = (await buffer.lease(1, 0, "")).leases
    await buffer.store.redis.set(dataplane.layout_key(buffer.store.ns), 999)
    client = async_client(redis_url)
    failed = asyncio.get_running_loop().create_future()
    rollout = Rollout(RolloutConfig(), pool=None, buffer=None, reward=None, redis=client, failed=failed)
    lease = buffer_pb2.Lease(lease_id=leased.lease_id, group=leased.group, submit_namespace=buffer.store.ns)
    try:
        with pytest.raises(dataplane.LayoutMismatch, match=MISMATCH):
            await rollout._submit(lease, finish(leased.group, [0.0, 1.0]))
        with pytest.raises(dataplane.LayoutMismatch, match=MISMATCH):  # what stops the gateway (Service.finished)
            await failed
        assert (await buffer.state())["num_completed_groups"] == 0
    finally:
        await client.aclose()
