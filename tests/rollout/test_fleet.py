"""The gateways' fleet in a real Redis: beats, the coordinator lease, each engine's one owner, hand-over when a
gateway stops beating or leaves, and engine discovery by DNS."""

import asyncio
import uuid

import redis.asyncio

from services.rollout.fleet import Fleet

URLS = [f"http://10.0.0.{i}:30000" for i in range(24)]


async def test_each_engine_has_one_owner_and_a_silent_gateway_hands_over(redis_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    run = uuid.uuid4().hex[:8]
    first, second = (Fleet(client, "t", run, me, ttl_s=1.0) for me in ("g1:1", "g2:2"))
    try:
        for fleet in (first, second, first):
            await fleet.beat()
        assert first.gateways == second.gateways == ["g1:1", "g2:2"]
        assert first.coordinating and not second.coordinating and second.coordinator == "g1:1"
        mine = {url for url in URLS if first.owns(url)}
        theirs = {url for url in URLS if second.owns(url)}
        assert mine and theirs and mine.isdisjoint(theirs) and mine | theirs == set(URLS)
        await asyncio.sleep(1.2)  # the first gateway stops beating: its engines and its lease move
        await second.beat()
        assert second.gateways == ["g2:2"] and second.coordinating
        assert all(second.owns(url) for url in URLS)
        await first.beat()  # back: it takes its share again, and the lease stays where it is
        await second.beat()
        assert {url for url in URLS if first.owns(url)} == mine and second.coordinating
        await second.leave()  # a stopping gateway hands over at once
        await first.beat()
        assert first.gateways == ["g1:1"] and first.coordinating
    finally:
        await client.aclose()


async def test_the_rollout_state_of_a_new_fleet_starts_clear(redis_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    run = uuid.uuid4().hex[:8]
    old, new = Fleet(client, "t", run, "old:1", ttl_s=0.5), Fleet(client, "t", run, "new:1", ttl_s=0.5)
    try:
        await old.beat()
        await old.set_started(True)
        await old.set_syncing(True, ttl_s=60)
        assert await new.started() and await new.syncing()
        await asyncio.sleep(0.7)  # every gateway of that fleet is gone: a new one must not follow its state
        await new.beat()
        assert not await new.started() and not await new.syncing()
    finally:
        await client.aclose()


async def test_discovery_makes_a_names_addresses_the_registry_entries(redis_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    fleet = Fleet(client, "t", uuid.uuid4().hex[:8], "g:1", ttl_s=5)
    try:
        await fleet.add("http://10.1.2.3:30000")  # registered by hand: discovery leaves it alone
        await fleet.add("http://10.9.9.9:30000", "dns:localhost:30000")  # a pod that is gone
        await fleet.discover("localhost", 30000)
        engines = await fleet.engines()
        assert engines["http://127.0.0.1:30000"] == "dns:localhost:30000"
        assert engines["http://10.1.2.3:30000"] == "registered" and "http://10.9.9.9:30000" not in engines
        await fleet.discover("no-such-name.invalid", 30000)  # does not resolve: the entries stay
        assert (await fleet.engines()).keys() == engines.keys()
    finally:
        await client.aclose()
