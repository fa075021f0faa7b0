"""Three buffer processes' worth of `Buffer` objects on one Redis, each with its own connection, called concurrently
in any mix: they give the guarantees of one buffer (no group held by two workers, every prompt trained exactly once,
the staleness bound and the backpressure cap never passed, one batch per step whichever replica is asked)."""

import asyncio
import random
import uuid

from services.buffer import prepared
from services.buffer.core import TRAIN
from services.buffer.source import READ_AHEAD
from services.buffer.store import Contended
from tests.buffer.conftest import finish, write_jsonl
from tests.redis_servers import async_client

REPLICAS, PROMPTS, BATCH, WORKERS = 3, 48, 4, 6


async def test_replicas_on_one_redis_hand_out_and_train_each_prompt_once(make_buffer, tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(PROMPTS)]
    config = {
        "prompt_data": str(write_jsonl(tmp_path / "p.jsonl", rows)),
        "run_id": "r" + uuid.uuid4().hex[:8],
        "num_epoch": 1,
        "rollout_batch_size": BATCH,
        "max_staleness": 1,
        "stale_policy": "mark",  # groups finish out of order: one leased at version v may be trained after v + 1
        "max_buffered_groups": 7,
        "rollout_shuffle": True,
    }
    replicas = [await make_buffer(**config) for _ in range(REPLICAS)]
    store, rng = replicas[0].store, random.Random(7)
    held: set[str] = set()
    steps = PROMPTS // BATCH

    async def check_bounds() -> None:
        counters, sizes = await store.counters(), await store.sizes(TRAIN)
        version = await replicas[0].policy_version()
        live = counters.get("started", 0) - counters.get("dropped", 0)
        assert live <= (version + 1) * BATCH + BATCH, f"{live} live groups at policy version {version}"
        assert sizes["leased"] + sizes["completed"] <= 7, f"past the cap: {sizes}"

    async def worker() -> None:
        while await store.meta_int("last_committed_step", -1) < steps - 1:
            result = await rng.choice(replicas).lease(rng.randint(1, 3), 0, "")
            await check_bounds()
            if not result.leases:
                await asyncio.sleep(0.01)
                continue
            for leased in result.leases:
                gid = leased.group.group_id
                assert gid not in held, f"{gid} was handed out while a worker held it"
                held.add(gid)
            for leased in result.leases:
                await asyncio.sleep(rng.random() * 0.01)
                done = finish(leased.group, [0.0, 1.0], version=result.policy_version)
                held.discard(leased.group.group_id)
                accepted, duplicate, _ = await rng.choice(replicas).submit(leased.lease_id, done)
                assert accepted and not duplicate

    async def trainer() -> list[list[str]]:
        trained = []
        for step in range(steps):
            first, second = rng.sample(replicas, 2)
            parts = await asyncio.gather(first.get_batch(step, 0, 2, 60), second.get_batch(step, 1, 2, 60))
            ids = [g.group_id for part in parts for g in part.groups]
            assert len(ids) == BATCH == len(set(ids)), "the two ranks' parts are one batch"
            trained.append(ids)
            await rng.choice(replicas).commit(step)
            await rng.choice(replicas).set_policy_version(step + 1)
        return trained

    *_, trained = await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(WORKERS)), trainer()), 120)
    flat = [gid for ids in trained for gid in ids]
    assert len(flat) == len(set(flat)) == PROMPTS, "every prompt trained exactly once"
    assert await store.violations() == []
    counters = await store.counters()
    assert counters["started"] == counters["trained"] == PROMPTS and counters.get("dropped", 0) == 0


async def test_a_rewind_amid_leases_on_other_replicas_keeps_the_state_whole(make_buffer, tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(40)]
    config = {
        "prompt_data": str(write_jsonl(tmp_path / "p.jsonl", rows)),
        "run_id": "w" + uuid.uuid4().hex[:8],
        "num_epoch": 1,
        "max_staleness": 100,
    }
    rewinder, *leasers = [await make_buffer(**config) for _ in range(3)]
    store, stop = rewinder.store, asyncio.Event()

    async def lease_and_submit(buffer) -> None:
        while not stop.is_set():
            for leased in (await buffer.lease(2, 0, "")).leases:
                await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0]))
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(lease_and_submit(b)) for b in leasers]
    for _ in range(5):
        await asyncio.sleep(0.05)
        await rewinder.rewind(0, 0)
        assert await store.violations() == []
    stop.set()
    await asyncio.gather(*tasks)
    status = await store.redis.hgetall(store.key("status"))
    assert await store.violations() == []
    assert (await store.counters())["started"] == len(status), "every started group has one status"


async def test_replicas_tokenize_each_prompt_once(make_buffer, tmp_path, monkeypatch):
    """Each replica reads the stream ahead of the leases; what one tokenized, the others read from Redis, and a chunk
    is deleted once its last prompt is leased."""
    import services.buffer.source as source

    tokenized: list[str] = []

    def counted(rows, spec):
        tokenized.extend(raw.data.decode() for raw in rows)
        return source_prepare_rows(rows, spec)

    source_prepare_rows = source.prepare_rows
    monkeypatch.setattr(source, "prepare_rows", counted)
    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(300)]
    config = {"prompt_data": str(write_jsonl(tmp_path / "p.jsonl", rows)), "run_id": "r" + uuid.uuid4().hex[:8],
              "num_epoch": 1, "max_staleness": 1000, "rollout_shuffle": True}  # fmt: skip
    replicas = [await make_buffer(**config) for _ in range(REPLICAS)]
    leased, rng = [], random.Random(3)
    while len(leased) < len(rows):
        result = await rng.choice(replicas).lease(rng.randint(1, 9), 0, "")
        leased += [leased.group.prompt_text for leased in result.leases]
    assert sorted(leased) == sorted(row["prompt"] for row in rows)
    assert len(tokenized) == len(set(tokenized)) == len(rows), "each prompt tokenized once"
    assert not await replicas[0].store.redis.keys(f"{replicas[0].store.ns}:prepared:*")


async def test_a_slow_claimer_is_waited_for_and_a_dead_ones_claim_is_taken_over(redis_url, monkeypatch):
    """A chunk is tokenized by its claimer however long that takes (it renews its claim), never by a waiter beside
    it; a claim whose process died expires, and the next process to look tokenizes the chunk."""
    monkeypatch.setattr(prepared, "CLAIM_TTL_MS", 300)
    monkeypatch.setattr(prepared, "RENEW_S", 0.05)
    redis, calls = async_client(redis_url), []
    chunks = prepared.SharedChunks(redis, "test:{c" + uuid.uuid4().hex[:8] + "}")

    async def tokenize(name: str, seconds: float = 0.0) -> list[bytes]:
        calls.append(name)
        await asyncio.sleep(seconds)
        return [name.encode()]

    try:
        slow = asyncio.ensure_future(chunks.prepare("0", lambda: tokenize("slow", 1.0)))  # over three claim lifetimes
        await asyncio.sleep(0.05)
        assert await chunks.prepare("0", lambda: tokenize("waiter")) == [b"slow"] == await slow
        await redis.set(f"{chunks.prefix}:1", b"", px=300)  # claimed by a process that died
        assert await chunks.prepare("1", lambda: tokenize("next")) == [b"next"]
        assert calls == ["slow", "next"]
    finally:
        await redis.aclose()


async def test_concurrent_leases_on_replicas_do_not_race_for_the_cursor(make_buffer, tmp_path):
    """New groups are made ahead a read-ahead at a time by one replica at a time; a lease takes them from the ready
    list in its one script, so leases from many replicas at once never make each other start again."""
    rows = [{"prompt": f"What is {i} + 2?", "label": str(i + 2)} for i in range(3 * READ_AHEAD + 100)]
    config = {"prompt_data": str(write_jsonl(tmp_path / "p.jsonl", rows)), "run_id": "r" + uuid.uuid4().hex[:8],
              "num_epoch": 1, "max_staleness": 1000, "rollout_shuffle": True}  # fmt: skip
    replicas = [await make_buffer(**config) for _ in range(REPLICAS)]
    calls = {"stage": 0, "lease_start": 0, "refused": 0}
    for replica in replicas:
        for name in ("stage", "lease_start"):
            calls_of(replica.store, name, calls)
    leased, rng, lease_calls = [], random.Random(5), 0

    async def worker() -> None:
        nonlocal lease_calls
        while len(leased) < len(rows):
            result = await rng.choice(replicas).lease(rng.randint(1, 9), 0, "")
            lease_calls += 1
            leased.extend(group.group.prompt_text for group in result.leases)
            if not result.leases:
                assert result.blocked == "exhausted"
                return

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(WORKERS * 2))), 120)
    assert sorted(leased) == sorted(row["prompt"] for row in rows), "each prompt leased once"
    # Each replica's read-ahead starts at a chunk and doubles up to READ_AHEAD: a few more at the start.
    read_aheads = -(-len(rows) // READ_AHEAD) + REPLICAS * (READ_AHEAD // 32).bit_length()
    assert calls["stage"] <= 2 * read_aheads, f"{calls['stage']} read-aheads for {len(rows)} prompts"
    assert calls["refused"] <= 2, f"{calls['refused']} read-aheads refused: replicas raced for the cursor"
    # One script a lease, but for the calls that find the list empty (at the start and the end: once more each).
    assert calls["lease_start"] <= lease_calls + 4 * WORKERS * 2, f"{calls['lease_start']} for {lease_calls} leases"
    assert await replicas[0].store.violations() == []


def calls_of(store, name: str, calls: dict) -> None:
    """Counts the store's calls of `name` in `calls[name]`, and those refused as contended in `calls["refused"]`."""
    method = getattr(store, name)

    async def counted(*args, **kwargs):
        calls[name] += 1
        try:
            return await method(*args, **kwargs)
        except Contended:
            calls["refused"] += 1
            raise

    setattr(store, name, counted)
