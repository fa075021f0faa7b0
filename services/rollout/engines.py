"""The engine pool: which engines exist, which are healthy, and where the next request goes.

Engines come from --engine-urls or register at run time; each one's TP size and weight version are read from its
/server_info and /model_info. A health loop calls /health_generate on every engine that has answered no request since
the last round (an answer is the better proof: a fleet of thousands would otherwise get a check and, past the HTTP
keep-alive, a new connection per engine every few seconds); consecutive failures (of health checks or of requests)
evict an engine, and an evicted engine that answers again is re-admitted. Requests go to the
least busy healthy engine, except that the samples of one prompt group stay on one engine (prefix affinity, by
consistent hashing) while it is not much busier than the others. A failed request is retried on another engine.
"""

import asyncio
import bisect
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import prometheus_client

from services.common.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from services.rollout.adapters import Adapters
from services.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

OUTSTANDING = prometheus_client.Gauge(
    "slipstream_rollout_engine_outstanding", "Requests in flight, by engine", ["engine"]
)

STARTING, HEALTHY, EVICTED, DRAINING = "starting", "healthy", "evicted", "draining"


@dataclass
class Engine:
    url: str
    state: str = STARTING
    tp_size: int = 1
    ordered_buckets: bool = False  # takes several weight buckets in flight, in `sequence` order (the reference engine)
    weight_version: str = ""
    model_path: str = ""
    outstanding: int = 0
    failures: int = 0
    last_error: str = ""
    version: str = ""  # the engine's SGLang version (0.5.21+ needs begin/end around weight updates)
    admissions: int = 0  # a re-admitted engine may have restarted: it is in no weight group any more
    gpus: tuple[int, ...] = (0,)  # of its TP ranks, in the node's numbering (SGLang's base_gpu_id, gpu_id_step)
    requests: set = field(default_factory=set)  # the tasks of its requests in flight, cancelled when it is evicted
    evicting: set = field(default_factory=set)  # those of them cancelled by its eviction (not by their callers)
    generates: bool = True  # False: another gateway of the fleet generates on it, this one only syncs its weights
    paused: bool = False  # told to pause (around a weight sync) and not yet to continue
    # Evicted while paused: it may hold part of a sync that did not commit on it, weights of no version. Re-admitted,
    # it stays paused and out of generation (weight_version "") until a sync commits on it.
    unversioned: bool = False
    answered_at: float = 0.0  # when (monotonic) it last answered a request: no health check is due for an interval

    changes = 0  # of any engine's state or share, process-wide: the pools' cached choices are rebuilt after one

    def __setattr__(self, name: str, value) -> None:
        if name in ("state", "generates", "unversioned"):
            Engine.changes += 1
        super().__setattr__(name, value)


class EngineFailure(Exception):
    """A request to an engine failed (connection, timeout, 5xx, malformed answer): try another engine."""


class EngineTimeout(EngineFailure):
    """A control call got no answer within its deadline: the engine is hung, unless the call waits for others."""


class EnginePool:
    def __init__(self, config: RolloutConfig):
        self.config = config
        self.engines: dict[str, Engine] = {}
        self._session: aiohttp.ClientSession | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._gauges: dict[str, object] = {}  # each engine's OUTSTANDING child, looked up once
        self.running = asyncio.Event()  # cleared while the engines are paused (around a weight sync)
        self.running.set()
        self.committed = asyncio.Event()  # set when a weight sync's version is in the buffer: the staleness bound moved
        self.router: Engine | None = None  # with --use-router, generation goes through it
        self._router_tasks: set[asyncio.Task] = set()
        self.paused_elsewhere = None  # async () -> bool: another gateway paused the engines (fleet.py)
        # (membership seen, the healthy engines, those this gateway generates on, those requests go to, their ring)
        self._lists: tuple = ((), [], [], [], None)
        self.adapters = Adapters(self, config.run_id) if config.lora_rank else None  # --lora-rank: the run's adapter

    # Membership

    async def register(self, url: str) -> Engine:
        url = normalize(url)
        if url in self.engines and self.engines[url].state != DRAINING:
            raise AlreadyExists(f"engine {url} is already registered")
        engine = Engine(url)
        self.engines[url] = engine
        self._slots[url] = asyncio.Semaphore(self.config.sglang_server_concurrency)
        try:
            await self._admit(engine)
        except EngineFailure as e:  # keep it: the health loop admits it once it answers
            self._fail(engine, str(e), evict=True)
        return engine

    def use_router(self, url: str) -> None:
        """Generation goes through the sglang-router at `url` from now on; membership changes are sent to it."""
        self.router = Engine(url, state=HEALTHY)
        self._slots[url] = asyncio.Semaphore(1 << 20)  # the router queues and balances by itself

    async def deregister(self, url: str) -> None:
        engine = self.engines.get(normalize(url))
        if engine is None:
            raise NotFound(f"no engine {url} is registered; ListEngines shows the registered ones")
        engine.state = DRAINING  # no new requests; in-flight ones finish
        self._tell_router(engine.url, joined=False)
        while engine.outstanding:
            await asyncio.sleep(0.05)
        self.engines.pop(engine.url, None)

    def healthy(self) -> list[Engine]:
        return self._membership()[0]

    def generating(self) -> list[Engine]:
        """The healthy engines this gateway generates on (in a fleet, its share)."""
        return self._membership()[1]

    def _membership(self) -> tuple:
        """(healthy, generating, the engines requests go to, their ring), listed again only after an engine's state or
        share changed: asked for on every lease and request, they would otherwise cost a pass over thousands of
        engines each time. Callers must not change them."""
        seen = (Engine.changes, len(self.engines))
        if self._lists[0] != seen:
            healthy = [e for e in self.engines.values() if e.state == HEALTHY]
            serving = [e for e in healthy if not e.unversioned]
            generating = [e for e in serving if e.generates]
            candidates = generating or serving  # a fleet coordinator with no engines of its own evaluates on others'
            ring = _ring(tuple(e.url for e in candidates)) if candidates else None
            self._lists = (seen, healthy, generating, candidates, ring)
        return self._lists[1:]

    async def _admit(self, engine: Engine) -> None:
        info = await self._get_json(engine, "/server_info")
        model = await self._get_json(engine, "/model_info")
        engine.tp_size = int(info.get("tp_size") or 1)
        base, step = int(info.get("base_gpu_id") or 0), int(info.get("gpu_id_step") or 1)
        engine.gpus = tuple(base + rank * step for rank in range(engine.tp_size))
        engine.version = str(info.get("version", ""))
        engine.ordered_buckets = bool(info.get("ordered_weight_buckets"))
        engine.weight_version = "" if engine.unversioned else str(model.get("weight_version", ""))
        engine.model_path = str(model.get("model_path", ""))
        engine.state, engine.failures, engine.last_error = HEALTHY, 0, ""
        engine.admissions += 1
        if not engine.unversioned:
            self._tell_router(engine.url, joined=True)
        log.info("engine %s admitted (tp %d, weight version %s)", engine.url, engine.tp_size, engine.weight_version)

    # Health

    async def check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.rollout_health_check_interval)
            if not self.running.is_set():  # a paused engine answers 503 on purpose
                continue
            await asyncio.gather(*(self.check(e) for e in self.due()))

    def due(self) -> list[Engine]:
        """The engines a health round checks: those that answered no request within the last interval."""
        since = time.monotonic() - self.config.rollout_health_check_interval
        return [e for e in self.engines.values() if e.state != DRAINING and e.answered_at < since]

    async def check(self, engine: Engine) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.rollout_health_check_timeout)
            # Paused on purpose, an unversioned engine answers /health_generate 503: only its server is checked.
            path = "/model_info" if engine.unversioned else "/health_generate"
            async with self.session.get(f"{engine.url}{path}", timeout=timeout) as response:
                if response.status != 200:
                    raise EngineFailure(f"{path} answered {response.status}")
            if engine.state == EVICTED:
                await self._admit(engine)
            engine.failures = 0
        except (aiohttp.ClientError, TimeoutError, EngineFailure) as e:
            if self.paused_elsewhere is not None and await self.paused_elsewhere():
                return  # paused for a weight sync: a paused engine answers 503 on purpose
            self._fail(engine, f"health check failed: {_describe(e)}")

    def _fail(self, engine: Engine, error: str, evict: bool = False) -> None:
        engine.failures += 1
        if engine.state == EVICTED:  # out already: last_error keeps why; it is back once a health check passes
            return
        engine.last_error = error
        if evict or engine.failures >= self.config.rollout_health_check_failures:
            engine.state = EVICTED
            engine.unversioned = engine.unversioned or engine.paused
            log.warning("engine %s evicted: %s", engine.url, error)
            if self.adapters is not None:
                self.adapters.forget(engine.url)
            for task in list(engine.requests):  # a hung engine would hold them until --request-timeout-s
                engine.evicting.add(task)
                task.cancel()
            self._tell_router(engine.url, joined=False)
        else:
            log.warning(
                "engine %s failed (%d of %d before eviction): %s",
                engine.url,
                engine.failures,
                self.config.rollout_health_check_failures,
                error,
            )

    def _tell_router(self, url: str, joined: bool) -> None:
        if self.router is not None:
            task = asyncio.create_task(self._router_membership(url, joined))
            self._router_tasks.add(task)
            task.add_done_callback(self._router_tasks.discard)

    async def _router_membership(self, url: str, joined: bool) -> None:
        """Adds or removes a worker of the sglang-router (POST /workers, DELETE /workers/{id})."""
        base = self.router.url
        try:
            if joined:
                worker = {"url": url, "api_key": self.config.engine_api_key()}  # the router's calls to it need it too
                async with self.session.post(f"{base}/workers", json=worker) as response:
                    response.raise_for_status()
                return
            async with self.session.get(f"{base}/workers") as response:
                workers = (await response.json())["workers"]
            for worker in (w for w in workers if w["url"].rstrip("/") == url):
                async with self.session.delete(f"{base}/workers/{worker['id']}") as response:
                    response.raise_for_status()
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
            log.warning("could not %s engine %s in the router: %s", "add" if joined else "remove", url, _describe(e))

    # Pause and resume (the partial-rollout hooks of a weight sync)

    async def pause(self, mode: str) -> None:
        """Pauses every engine: `abort` ends in-flight requests now (their samples come back ABORTED with the tokens
        so far), `retract` and `in_place` keep them to continue after `resume`. New requests wait in the gateway."""
        self.running.clear()
        for engine in self.healthy():
            engine.paused = True
        await self.control("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Generation goes on, on every healthy engine but the unversioned ones (they stay paused)."""
        engines = [e for e in self.healthy() if not e.unversioned]
        await self.control("/continue_generation", {}, engines)
        for engine in engines:
            engine.paused = False
        self.running.set()

    def serves(self, engine: Engine, version: str) -> None:
        """A weight sync committed `version` on the engine; one that was unversioned generates again."""
        engine.weight_version = version
        if engine.unversioned:
            engine.unversioned = False
            self._tell_router(engine.url, joined=True)

    async def control(self, path: str, payload: dict, engines: list[Engine] | None = None) -> dict[str, str]:
        """POSTs a control call to every healthy engine (or to `engines`) directly and concurrently; returns the
        errors by engine URL (an engine that fails is evicted, the others go on)."""
        engines = self.healthy() if engines is None else engines
        results = await asyncio.gather(*(self._control(e, path, payload) for e in engines), return_exceptions=True)
        errors = {}
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, Exception):
                errors[engine.url] = _describe(result)
                self._fail(engine, f"{path} failed: {errors[engine.url]}", evict=True)
        return errors

    async def alive(self, engine: Engine) -> bool:
        """Whether the engine's server answers at all (GET /model_info: /health answers 503 while paused)."""
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self.session.get(f"{engine.url}/model_info", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def evict(self, engine: Engine, reason: str) -> None:
        self._fail(engine, reason, evict=True)

    async def post_control(self, engine: Engine, path: str, payload: dict, timeout_s: float, url: str = "") -> dict:
        """One control call to one engine (never through the router), with its own deadline; `url`: to the weight
        receiver beside it instead."""
        return await self._control(engine, path, payload, timeout_s, url)

    async def _control(self, engine: Engine, path: str, payload: dict, timeout_s: float | None = None, url: str = ""):
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.config.rollout_health_check_timeout)
        for attempt in (1, 2):
            try:
                async with self.session.post(f"{url or engine.url}{path}", json=payload, timeout=timeout) as response:
                    body = await response.read()
                break
            except aiohttp.ServerDisconnectedError as e:
                # A kept-alive connection the server closed as it was reused: the call never ran. Once more, for
                # the calls that are safe to repeat.
                if attempt == 2 or path not in IDEMPOTENT:
                    raise EngineFailure(_describe(e)) from None
            except TimeoutError:  # aiohttp's deadline (its ServerTimeoutError is a ClientError too)
                raise EngineTimeout(f"no answer within {timeout.total:g} s") from None
            except aiohttp.ClientError as e:
                raise EngineFailure(_describe(e)) from None
        if response.status != 200:
            raise EngineFailure(f"HTTP {response.status}: {_error_text(body)}")
        return json.loads(body) if body else {}

    # Requests

    def pick(self, affinity: str | None = None, avoid: set[str] | frozenset = frozenset()) -> Engine:
        candidates, ring = self._candidates()
        if avoid:
            candidates = [e for e in candidates if e.url not in avoid] or [
                e for e in self.healthy() if e.url not in avoid
            ]
            ring = None
        if not candidates:
            raise Unavailable("no healthy engine; register one (RegisterEngine) or wait for re-admission")
        if affinity is not None:
            keys, owners = ring or _ring(tuple(e.url for e in candidates))
            preferred = candidates[owners[bisect.bisect(keys, _hash(affinity)) % len(keys)]]
            if preferred.outstanding <= self.config.affinity_slack:  # within the slack of any engine: no search
                return preferred
        least = min(candidates, key=lambda e: e.outstanding)
        if affinity is None:
            return least
        return preferred if preferred.outstanding <= least.outstanding + self.config.affinity_slack else least

    def _candidates(self) -> tuple[list[Engine], tuple[list[int], list[int]] | None]:
        """The engines requests go to and their ring (`_membership`)."""
        return self._membership()[2:]

    async def generate(self, payload: dict, affinity: str | None = None) -> tuple[dict | list, Engine]:
        """POSTs /generate to an engine, retrying on another one when it fails; returns the answer and the engine."""
        if self.router is not None:
            return await self._through_router(payload), self.router
        tried: set[str] = set()
        last = ""
        for _ in range(self.config.max_retries + 1):
            await self.running.wait()
            try:
                engine = self.pick(affinity, tried)
            except Unavailable:
                if tried:
                    break
                raise
            tried.add(engine.url)
            try:
                answer = await self._generate_on(engine, payload)
            except EngineFailure as e:
                last = f"{engine.url}: {e}"
                self._fail(engine, f"/generate failed: {e}")
                continue
            engine.answered_at, engine.failures = time.monotonic(), 0
            return answer, engine
        raise Unavailable(f"/generate failed on {len(tried)} engine(s); last error {last}")

    async def _generate_on(self, engine: Engine, payload: dict):
        if self.adapters is None:
            return await self._post(engine, "/generate", payload)
        payload, version = await self.adapters.request(engine, payload)
        try:
            return self.adapters.label(await self._post(engine, "/generate", payload), version)
        finally:
            self.adapters.done(payload)

    async def _through_router(self, payload: dict):
        last = ""
        for _ in range(self.config.max_retries + 1):
            await self.running.wait()
            if not self.healthy():
                raise Unavailable("no healthy engine; register one (RegisterEngine) or wait for re-admission")
            try:
                return await self._generate_on(self.router, payload)
            except EngineFailure as e:
                last = str(e)
                await asyncio.sleep(0.5)  # the router may not have noticed a dead engine yet
        raise Unavailable(f"/generate through the router {self.router.url} failed; last error {last}")

    @property
    def session(self) -> aiohttp.ClientSession:
        """One HTTP client for all engines (aiohttp: an order of magnitude more requests/s than httpx here)."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
            # Idle connections are dropped before uvicorn's (SGLang's server) 5 s keep-alive closes them under us.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
            key = self.config.engine_api_key()
            headers = {"Authorization": f"Bearer {key}"} if key else None  # SGLang's --api-key
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
        return self._session

    async def _post(self, engine: Engine, path: str, payload: dict):
        gauge = self._gauges.get(engine.url) or self._gauges.setdefault(engine.url, OUTSTANDING.labels(engine.url))
        async with self._slots[engine.url]:
            engine.outstanding += 1
            gauge.inc()
            task = asyncio.current_task()  # the caller's: an eviction cancels it here, no task of our own per request
            engine.requests.add(task)
            try:
                status, body = await self._fetch(f"{engine.url}{path}", payload)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise EngineFailure(_describe(e)) from None
            except asyncio.CancelledError:
                if task not in engine.evicting or task.uncancel():  # the caller is cancelled (too)
                    raise
                raise EngineFailure(f"evicted with this request in flight ({engine.last_error})") from None
            finally:
                engine.requests.discard(task)
                engine.evicting.discard(task)
                engine.outstanding -= 1
                gauge.dec()
        if status >= 500:
            raise EngineFailure(f"HTTP {status}: {body[:200]!r}")
        if status >= 400:  # our request was bad: another engine would refuse it too
            raise InvalidArgument("payload", f"{engine.url}{path} refused it: {body[:300].decode(errors='replace')}")
        try:
            return json.loads(body)
        except ValueError:
            raise EngineFailure(f"malformed JSON from {path}: {body[:200]!r}") from None

    async def _fetch(self, url: str, payload: dict) -> tuple[int, bytes]:
        async with self.session.post(url, json=payload) as response:
            return response.status, await response.read()

    async def _get_json(self, engine: Engine, path: str) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.config.rollout_health_check_timeout)
        try:
            async with self.session.get(f"{engine.url}{path}", timeout=timeout) as response:
                response.raise_for_status()
                return json.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise EngineFailure(f"{path}: {_describe(e)}") from None

    async def close(self) -> None:
        if self.adapters is not None:
            await self.adapters.close()
        if self._session is not None:
            await self._session.close()


IDEMPOTENT = {
    "/pause_generation",
    "/continue_generation",
    "/update_weight_version",
    "/begin_weight_update",
    "/end_weight_update",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/flush_cache",
}


RING_POINTS = 16  # each engine's places on the hash ring: shares within a few percent of equal


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=8)
def _ring(urls: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """The consistent-hashing ring of these engines (a group keeps its engine while they stay; one that leaves or
    joins moves only its own share): the points in order, and the index of the engine at each. Built once per
    membership, so that a request costs a lookup, not a hash per engine (thousands of engines a gateway)."""
    points = sorted((_hash(f"{url}#{k}"), index) for index, url in enumerate(urls) for k in range(RING_POINTS))
    return [point for point, _ in points], [index for _, index in points]


def normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument("url", f"{url!r} is not an engine URL; use http://host:port")
    return url


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _error_text(body: bytes) -> str:
    """What an engine said of a failed call: the message of SGLang's control answer (a NCCL error is long and its
    cause comes last), else the start of the body."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message)[:2000] if message else repr(body[:200])
