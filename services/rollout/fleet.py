"""Gateway replicas of one run, coordinated in Redis (with --redis-url; without it, the one gateway owns every engine).

- The engine registry is a hash of engine URLs: --engine-urls, launched engines and RegisterEngine add to it from any
  gateway, DeregisterEngine removes from it, and --engine-discovery names (a Kubernetes headless Service) are resolved
  again and again by the coordinator, which adds the addresses found and removes those gone.
- Each gateway beats every --fleet-heartbeat-s into a sorted set with an expiry; one whose beats stop is dropped.
- Each engine is generated on by one gateway, the one that rendezvous hashing of (engine, gateway) ranks first among
  the live gateways: a gateway that dies hands its engines to the others, and a new one takes a share, with no
  other engine moving.
- The coordinator is the gateway that holds a Redis lease (SET NX PX, renewed by its beats; a dead coordinator's lease
  expires and the next beat of another gateway takes it). It runs every weight sync for every engine of the run: the
  trainer may call any gateway (round robin over them), which forwards the weight-sync calls to the coordinator.
  While a sync runs, the engines are paused (their new requests wait in them), which the other gateways read here,
  so that their health checks do not evict a paused engine.
- StartRollout and StopRollout on any gateway set the run's rollout state here; every gateway follows it.

All keys are `<prefix>:{<run_id>}:fleet:…`, in the run's Redis Cluster slot.
"""

import asyncio
import contextlib
import functools
import hashlib
import logging
import socket

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.rollout.engines import DRAINING, EnginePool

log = logging.getLogger(__name__)

# ARGV: me, ttl ms. Beats, drops the gateways whose beats stopped, takes or renews the coordinator lease; returns
# the coordinator, then the live gateways.
_BEAT = """
local ns, me, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', ns .. ':gateways', '-inf', now)
if redis.call('ZCARD', ns .. ':gateways') == 0 then  -- the first of a new fleet: no rollout or sync is under way
  redis.call('DEL', ns .. ':started', ns .. ':syncing')
end
redis.call('ZADD', ns .. ':gateways', now + ttl, me)
local coordinator = redis.call('GET', ns .. ':coordinator')
if coordinator == me then
  redis.call('PEXPIRE', ns .. ':coordinator', ttl)
elseif not coordinator then
  redis.call('SET', ns .. ':coordinator', me, 'PX', ttl)
  coordinator = me
end
local out = {coordinator}
for _, gateway in ipairs(redis.call('ZRANGE', ns .. ':gateways', 0, -1)) do table.insert(out, gateway) end
return out
"""


class Fleet:
    def __init__(self, redis: Redis, prefix: str, run_id: str, me: str, ttl_s: float):
        self.redis, self.me, self.ttl_ms = redis, me, int(ttl_s * 1000)
        self.ns = f"{prefix}:{{{run_id}}}:fleet"
        self._beat = redis.register_script(_BEAT)
        self.gateways: list[str] = [me]
        self.coordinator: str | None = None

    @property
    def coordinating(self) -> bool:
        return self.coordinator == self.me

    async def beat(self) -> None:
        coordinator, *gateways = await self._beat(keys=[f"{self.ns}:gateways"], args=[self.ns, self.me, self.ttl_ms])
        was = self.coordinator
        self.coordinator, self.gateways = coordinator.decode(), sorted(g.decode() for g in gateways)
        if self.coordinator != was:
            log.info("the coordinator of the gateways is %s%s", self.coordinator, " (this one)" * self.coordinating)

    def owns(self, url: str) -> bool:
        """Whether this gateway generates on the engine at `url` (rendezvous hashing over the live gateways)."""
        return owner(url, tuple(self.gateways or [self.me])) == self.me

    async def leave(self) -> None:
        """A stopping gateway hands its engines (and the coordinator lease) over at once."""
        await self.redis.zrem(f"{self.ns}:gateways", self.me)
        if self.coordinating:
            await self.redis.delete(f"{self.ns}:coordinator")

    # The engine registry

    async def engines(self) -> dict[str, str]:
        """Engine URL → how it joined (`registered`, or `dns:<name>:<port>` for a discovered one)."""
        found = await self.redis.hgetall(f"{self.ns}:engines")
        return {url.decode(): source.decode() for url, source in found.items()}

    async def add(self, url: str, source: str = "registered") -> None:
        await self.redis.hset(f"{self.ns}:engines", url, source)

    async def remove(self, url: str) -> bool:
        return bool(await self.redis.hdel(f"{self.ns}:engines", url))

    async def discover(self, name: str, port: int) -> None:
        """Resolves `name` (a headless Service: one address per engine pod) and makes its addresses the registry's
        entries of that name."""
        source = f"dns:{name}:{port}"
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:  # the name may have no pods yet: keep what is registered, try again later
            log.warning("engine discovery: %s does not resolve (%s)", name, e)
            return
        found = {f"http://{_host(info[4][0])}:{port}" for info in infos}
        known = {url for url, s in (await self.engines()).items() if s == source}
        for url in found - known:
            await self.add(url, source)
        for url in known - found:
            await self.remove(url)
        if found != known:
            log.info("engine discovery: %s resolves to %d engine(s)", name, len(found))

    # The run's rollout state and the weight syncs

    async def set_started(self, started: bool) -> None:
        await self.redis.set(f"{self.ns}:started", int(started))

    async def started(self) -> bool:
        return await self.redis.get(f"{self.ns}:started") == b"1"

    async def set_syncing(self, syncing: bool, ttl_s: float) -> None:
        """The coordinator marks the engines as paused for a sync (expiring, should it die meanwhile)."""
        if syncing:
            await self.redis.set(f"{self.ns}:syncing", self.me, px=int(ttl_s * 1000))
        else:
            await self.redis.delete(f"{self.ns}:syncing")

    async def syncing(self) -> bool:
        return bool(await self.redis.exists(f"{self.ns}:syncing"))


@functools.lru_cache(maxsize=1 << 16)  # each heartbeat asks again for every engine, of thousands
def owner(url: str, gateways: tuple[str, ...]) -> str:
    return max(gateways, key=lambda gateway: hashlib.blake2b(f"{url}|{gateway}".encode()).digest())


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def own_address(host: str, port: int) -> str:
    """How the other gateways reach this one: its host, or on a wildcard host this machine's (pod's) address."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


async def follow(fleet: Fleet, pool: EnginePool, rollout, config) -> None:
    """A fleet gateway's loop: beat, follow the registry and the run's rollout state, and as the coordinator resolve
    the discovery names."""
    discovered_at = float("-inf")
    loop = asyncio.get_running_loop()
    while True:
        try:
            await fleet.beat()
            if fleet.coordinating and loop.time() - discovered_at >= config.engine_discovery_interval_s:
                for entry in config.engine_discovery:
                    name, _, port = entry.rpartition(":")
                    await fleet.discover(name, int(port))
                discovered_at = loop.time()
            await reconcile(fleet, pool)
            if await fleet.started():
                rollout.start()
            elif rollout.running:
                await rollout.stop(abort_in_flight=False)
        except (RedisError, OSError) as e:  # Redis may be briefly away: the engines keep their gateways meanwhile
            log.warning("the gateways' registry in Redis is unreachable: %s", e)
        await asyncio.sleep(config.fleet_heartbeat_s)


async def reconcile(fleet: Fleet, pool: EnginePool) -> None:
    """The pool holds the engines this gateway generates on and, on the coordinator, every engine (it syncs them)."""
    registry = await fleet.engines()
    for url in registry:
        owned = fleet.owns(url)
        engine = pool.engines.get(url)
        if (owned or fleet.coordinating) and (engine is None or engine.state == DRAINING):
            with contextlib.suppress(Exception):  # kept evicted if it does not answer; admitted once it does
                engine = await pool.register(url)
        if engine is not None and engine.generates != owned:
            engine.generates = owned
            log.info("engine %s: %s", url, "generated on by this gateway" if owned else "another gateway's")
    for url, engine in list(pool.engines.items()):
        if engine.state != DRAINING and (url not in registry or not (fleet.owns(url) or fleet.coordinating)):
            task = asyncio.create_task(_drain(pool, url))
            _DRAINING.add(task)
            task.add_done_callback(_DRAINING.discard)


_DRAINING: set[asyncio.Task] = set()


async def _drain(pool: EnginePool, url: str) -> None:
    with contextlib.suppress(Exception):  # gone already
        await pool.deregister(url)  # its requests in flight finish first
