"""A worker completing its training groups in the buffer's Redis itself (services.buffer.dataplane.complete_in_redis),
against a real Redis and a real buffer: the same transition as SubmitGroup, once per group, with the buffer told."""

import asyncio

import pytest

from services.buffer import core
from services.buffer import dataplane as store_module
from services.buffer.dataplane import complete_in_redis
from services.buffer.store import BufferStore
from services.common.errors import InvalidArgument, NotFound
from services.rollout.submits import SubmitBatcher
from slipstream import samples
from slipstream.v1 import buffer_pb2
from tests.buffer.conftest import finish
from tests.redis_servers import async_client, subscribers


def as_lease(buffer, leased) -> buffer_pb2.Lease:
    """What LeasePrompts hands a worker (services/buffer/servicer.py)."""
    return buffer_pb2.Lease(lease_id=leased.lease_id, group=leased.group, submit_namespace=buffer.store.ns)


@pytest.fixture
async def worker_store(redis_url):
    """`worker_store(buffer)`: the worker's own client, on the namespace its leases name."""
    clients = []

    def make(buffer) -> BufferStore:
        clients.append(client := async_client(redis_url))
        return BufferStore(client, buffer.store.ns)

    yield make
    for client in clients:
        await client.aclose()


async def test_completed_groups_are_batched_with_their_arrays_once(make_buffer, worker_store):
    buffer = await make_buffer()
    store = worker_store(buffer)
    leases = (await buffer.lease(4, 0, "")).leases
    sent = [finish(leased.group, [0.0, 1.0], version=3) for leased in leases]
    expected = {g.group_id: [s.tokens for s in g.samples] for g in sent}
    for leased, group in zip(leases, sent, strict=True):
        assert await complete_in_redis(store, as_lease(buffer, leased), group)
        assert not any(s.tokens for s in group.samples)  # the arrays went to Redis
    retry = finish(leases[0].group, [0.0, 1.0])
    assert not await complete_in_redis(store, as_lease(buffer, leases[0]), retry)  # counted once
    assert not await store.redis.keys(f"{store.ns}:upload:*")  # the retry's upload went with it
    part = await buffer.get_batch(0, 0, 1, 5, arrays_from_redis=True)
    groups = part.groups
    samples.put_batch_arrays(groups, [await store.redis.get(key) for key in part.arrays_keys])
    assert {g.group_id: [s.tokens for s in g.samples] for g in groups} == expected
    assert {g.min_weight_version for g in groups} == {3}
    assert part.num_tokens == sum(len(t) // 4 for tokens in expected.values() for t in tokens)
    state = await buffer.state()
    assert state["counters"]["completed"] == 4 and state["counters"]["duplicate_submits"] == 1
    assert await buffer.commit(0) == 4
    assert await store.redis.exists(*part.arrays_keys) == 0


async def test_bad_groups_and_unknown_leases_are_refused_and_nothing_is_written(make_buffer, worker_store):
    buffer = await make_buffer()
    store = worker_store(buffer)
    (leased,) = (await buffer.lease(1, 0, "")).leases
    with pytest.raises(InvalidArgument, match=r"group.samples: expected 2 samples"):
        await complete_in_redis(store, as_lease(buffer, leased), finish(leased.group, [1.0]))
    # The arrays are checked as they are taken out of the group (samples.take_sized_arrays), as SubmitGroup checks them.
    cut, short_mask, odd = (finish(leased.group, [0.0, 1.0]) for _ in range(3))
    cut.samples[1].tokens = cut.samples[1].tokens[:-4]
    short_mask.samples[0].loss_mask = short_mask.samples[0].loss_mask[:-1]
    odd.samples[0].rollout_logprobs += b"\0"
    for group, error in ((cut, r"samples\[1\].tokens: has \d+ tokens but prompt_length"),
                         (short_mask, r"samples\[0\].loss_mask: has 2 entries; it needs one per response token \(3\)"),
                         (odd, r"samples\[0\].tokens: tokens and rollout_logprobs hold 4-byte values")):  # fmt: skip
        with pytest.raises(InvalidArgument, match=error):
            await complete_in_redis(store, as_lease(buffer, leased), group)
    unknown = buffer_pb2.Lease(lease_id="train:e9:b9:r9#1", group=leased.group)  # of no group of this run
    with pytest.raises(NotFound, match="is unknown to the run"):
        await complete_in_redis(store, unknown, finish(leased.group, [0.0, 1.0]))
    assert (await buffer.state())["num_leased_groups"] == 1
    assert not await store.redis.keys(f"{store.ns}:upload:*") and not await store.redis.keys(f"{store.ns}:arrays:*")


async def test_a_waiting_batch_is_told_of_each_group(make_buffer, worker_store, monkeypatch):
    """The submit script publishes each completed group; the buffer, following them while a GetBatch waits, wakes it
    at once rather than at its next look, whichever process completed the group (its looks are made minutes apart
    here, so only the message can wake it). Nobody waiting, it does not listen: every buffer process would read every
    submit."""
    monkeypatch.setattr(core, "BATCH_POLL_S", 300.0)
    buffer = await make_buffer(rollout_batch_size=1)
    store = worker_store(buffer)
    channel = buffer.store.key("submitted")
    following = asyncio.create_task(buffer.follow_submits())
    try:
        (leased,) = (await buffer.lease(1, 0, "")).leases
        assert await subscribers(store.redis, channel) == 0
        waiting = asyncio.create_task(buffer.get_batch(0, 0, 1, 240))
        while await subscribers(store.redis, channel) < 1:
            await asyncio.sleep(0.05)
        await complete_in_redis(store, as_lease(buffer, leased), finish(leased.group, [0.0, 1.0]))
        batch = await asyncio.wait_for(waiting, 60)
        assert [g.group_id for g in batch.groups] == [leased.group.group_id]
        while await subscribers(store.redis, channel) > 0:  # nobody waits: it stops listening
            await asyncio.sleep(0.05)
    finally:
        following.cancel()


async def test_a_redis_that_lost_its_scripts_is_given_them_again(make_buffer, worker_store):
    buffer = await make_buffer()
    store = worker_store(buffer)
    (leased,) = (await buffer.lease(1, 0, "")).leases
    await store.redis.script_flush()  # as after a restart of Redis
    assert await complete_in_redis(store, as_lease(buffer, leased), finish(leased.group, [0.0, 1.0]))
    assert (await buffer.state())["num_completed_groups"] == 1


async def test_groups_finished_together_are_completed_in_one_call_each_once(make_buffer, worker_store, monkeypatch):
    """A gateway's groups finished at the same moment go in one round trip (services/rollout/submits.py): small arrays
    in the script's call, large ones uploaded first and renamed into place; each group is answered as on its own."""
    monkeypatch.setattr(store_module, "INLINE_ARRAYS", 300)  # the long responses below are uploaded, the rest inline
    buffer = await make_buffer(rollout_batch_size=6)
    store = worker_store(buffer)
    leases = (await buffer.lease(6, 0, "")).leases
    sent = [finish(leased.group, [0.0, 1.0], response_len=3 if i % 2 else 40) for i, leased in enumerate(leases)]
    expected = {g.group_id: [s.tokens for s in g.samples] for g in sent}
    submitter = SubmitBatcher()
    calls = []
    monkeypatch.setattr(store, "complete", lambda groups, complete=store.complete: calls.append(len(groups))
                        or complete(groups))  # fmt: skip
    pairs = [*zip(leases, sent, strict=True), (leases[0], finish(leases[0].group, [0.0, 1.0]))]  # one submitted twice
    completed = await asyncio.gather(*(submitter.complete(store, as_lease(buffer, leased), group)
                                       for leased, group in pairs))  # fmt: skip
    assert calls == [7] and completed == [True] * 6 + [False]
    assert not await store.redis.keys(f"{store.ns}:upload:*")
    unknown = buffer_pb2.Lease(lease_id="train:e9:b9:r9#1", group=leases[0].group)
    with pytest.raises(NotFound, match="is unknown to the run"):
        await submitter.complete(store, unknown, finish(leases[0].group, [0.0, 1.0]))
    part = await buffer.get_batch(0, 0, 1, 5, arrays_from_redis=True)
    groups = part.groups
    samples.put_batch_arrays(groups, [await store.redis.get(key) for key in part.arrays_keys])
    assert {g.group_id: [s.tokens for s in g.samples] for g in groups} == expected
    counters = (await buffer.state())["counters"]
    assert counters["completed"] == 6 and counters["duplicate_submits"] == 1
    assert not await buffer.store.violations()
