"""A model-based test of the gateway's side of weight sync (services/rollout/weight_sync.py): hypothesis drives a real
`WeightSync` over two fake engines that speak SGLang's HTTP API in this process, through random orders of a trainer's
Prepare (of a new version, or of the same one again), buckets, Commit and Abort, the trainer's stream ending, and an
engine refusing a bucket. After every step it checks what the fault tests check after theirs: no engine serves a
version of which it did not load every bucket, every engine a commit answered for serves that version, an open sync
waits for the trainer only with a deadline, and generation runs once no sync is open, or holds when engines keep part
of an aborted one.

`make test` runs a bounded number of examples; `make test-slow` runs the machine for 10 minutes."""

import asyncio
import contextlib
import time

import hypothesis.strategies as st
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from services.common.errors import FailedPrecondition, Unavailable
from services.rollout.config import RolloutConfig
from services.rollout.engines import EVICTED, EnginePool
from services.rollout.weight_sync import PEERS_FAIL_S, WeightSync
from services.weightsync.protocol import Bucket
from services.weightsync.protocol import GatewayPhase as Phase

BUCKETS = 2  # of every version: "v3.b0", "v3.b1"
SOURCES = [("weights-0", "127.0.0.1", 29500)]


def names(version: int) -> set[str]:
    return {f"v{version}.b{index}" for index in range(BUCKETS)}


class FakeEngine:
    """As much of an SGLang server as a weight sync uses: it loads the buckets it is sent (their names), takes a
    version when told, and records it as a violation when that version's buckets are not all loaded."""

    def __init__(self):
        self.version, self.loaded, self.violations, self.refuse = "0", set(), [], False
        self.paused = False
        self.server: TestServer | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        if path in ("/health", "/health_generate"):
            return web.Response()
        if path == "/server_info":
            return web.json_response({"tp_size": 1, "base_gpu_id": 0, "gpu_id_step": 1, "version": "0.5.23"})
        if path == "/model_info":
            return web.json_response({"model_path": "stand-in", "weight_version": self.version})
        if path == "/update_weights_from_distributed":
            if self.refuse:
                self.refuse = False
                return web.json_response({"success": False, "message": "refused (the test's fault)"})
            self.loaded |= set(body["names"])
        elif path == "/update_weight_version":
            version = body["new_version"]
            if not names(int(version)) <= self.loaded:
                self.violations.append(f"serves version {version} holding {sorted(self.loaded)}")
            self.version, self.loaded = version, set()
        elif path == "/pause_generation":
            self.paused = True
        elif path == "/continue_generation":
            self.paused = False
        return web.json_response({"success": True, "message": "done"})


class Buffer:
    async def SetPolicyVersion(self, request, timeout=None, wait_for_ready=None):
        return None


class WeightSyncMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engines = [FakeEngine(), FakeEngine()]
        urls = [self.run(engine.start()) for engine in self.engines]
        self.pool = EnginePool(RolloutConfig(weight_sync_timeout_s=30))
        self.by_url = dict(zip(urls, self.engines, strict=True))
        for url in urls:
            self.run(self.pool.register(url))
        self.pool.running.set()
        self.sync = WeightSync(self.pool.config, self.pool, Buffer())
        self.version = 0  # the trainer's latest
        self.sent: set[int] = set()  # the buckets the trainer sent since its last Prepare, each answered
        self.ended = "committed"  # how the last sync ended: committed, aborted (partial or not)

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def teardown(self):
        if self.sync.attempt is not None and self.sync.attempt.deadline is not None:
            self.sync.attempt.deadline.cancel()
        self.run(self.pool.close())
        for engine in self.engines:
            self.run(engine.server.close())
        self.loop.close()

    @rule(again=st.booleans())
    def prepare(self, again):
        if not (again and self.sync.attempt is not None):
            self.version += 1
        self.sent = set()  # a Prepare starts the sending over
        with contextlib.suppress(FailedPrecondition, Unavailable):  # the engines changed, or none is left
            self.run(self.sync.prepare(self.version, SOURCES, "gloo"))

    @precondition(lambda self: self.sync.attempt is not None)
    @rule(index=st.integers(0, BUCKETS - 1))
    def bucket(self, index):
        name = f"v{self.version}.b{index}"
        with contextlib.suppress(FailedPrecondition):  # an engine left: the trainer prepares again
            loading = self.run(self.sync.bucket(Bucket(index, [name], ["bfloat16"], [[2]], group_name="weights-0")))
            if all(result.success for result in self.run(asyncio.wait_for(loading, 30))):
                self.sent.add(index)

    @precondition(lambda self: self.sync.attempt is not None and len(self.sent) == BUCKETS)
    @rule()
    def commit(self):  # as the trainer does: once every bucket since its Prepare was answered
        attempt = self.sync.attempt
        try:
            results = self.run(self.sync.commit(self.version))
        except FailedPrecondition:
            return
        self.ended = "committed"
        for result in results:
            engine = self.by_url[result.url]
            assert not result.success or engine.version == str(attempt.version), (result, engine.version)

    @precondition(lambda self: self.sync.attempt is not None)
    @rule()
    def abort(self):
        partial = self.sync.attempt.partial
        self.run(self.sync.abort(self.version, "the trainer went away"))
        self.ended = "aborted partial" if partial else "aborted"

    @precondition(lambda self: self.sync.attempt is not None)
    @rule(cut=st.booleans())
    def stream_ends(self, cut):  # cut: the trainer died mid-stream
        async def ended():
            self.sync.stream_ended(cut)

        self.run(ended())

    @rule(which=st.integers(0, 1))
    def engine_refuses_its_next_bucket(self, which):
        self.engines[which].refuse = True

    @invariant()
    def no_engine_serves_a_version_it_does_not_hold(self):
        assert [v for engine in self.engines for v in engine.violations] == []

    @invariant()
    def an_open_sync_waits_for_the_trainer_with_a_deadline(self):
        attempt = self.sync.attempt
        if attempt is not None and attempt.phase is not Phase.COMMITTING:
            assert attempt.deadline is not None and not attempt.deadline.cancelled()

    @invariant()
    def generation_runs_once_no_sync_is_open_unless_engines_hold_part_of_one(self):
        if self.sync.attempt is None and any(e.state != EVICTED for e in self.pool.engines.values()):
            assert self.pool.running.is_set() == (self.ended != "aborted partial"), self.ended


def test_weight_sync_holds_its_invariants_in_any_order_of_events():
    run_state_machine_as_test(
        WeightSyncMachine,
        settings=settings(max_examples=25, stateful_step_count=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_weight_sync_holds_its_invariants_for_ten_minutes():
    end = time.monotonic() + 600
    while time.monotonic() < end:
        run_state_machine_as_test(
            WeightSyncMachine,
            settings=settings(max_examples=100, stateful_step_count=30, deadline=None, database=None,
                              suppress_health_check=[HealthCheck.too_slow]),
        )  # fmt: skip


class HangingEngine(FakeEngine):
    """Answers bucket 0 only once bucket 1 has come (the gateway posts an ordered engine the next bucket at once),
    then hangs on bucket 1 until the gateway's deadline, and its /model_info for a while after (as a stopped engine
    answers the gateway's probe only by its deadline)."""

    def __init__(self):
        super().__init__()
        self.second = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/server_info":
            info = {"tp_size": 1, "version": "0.5.23", "ordered_weight_buckets": True}
            return web.json_response(info)
        if request.path == "/model_info" and self.second.is_set():
            await asyncio.sleep(1.5)
        if request.path == "/update_weights_from_distributed":
            body = await request.json()
            if body["names"] == ["v1.b1"]:
                self.second.set()
                await asyncio.sleep(3600)
            await self.second.wait()
            return web.json_response({"success": True, "message": "done"})
        return await super().handle(request)


async def test_a_trainer_waiting_for_a_buckets_answer_is_not_taken_for_gone():
    """Bucket 0 is answered while bucket 1 still loads; bucket 1's answer comes only after the engine's deadline and
    the probe that finds it hung, later than a deadline counted from bucket 0's answer. The trainer, silent while it
    waits for that answer, hears the failure (and prepares again), not an abort for its silence."""
    engine = HangingEngine()
    pool = EnginePool(RolloutConfig(weight_sync_timeout_s=2))
    await pool.register(await engine.start())
    pool.running.set()
    sync = WeightSync(pool.config, pool, Buffer())
    try:
        await sync.prepare(1, SOURCES, "gloo")
        buckets = [Bucket(i, [f"v1.b{i}"], ["bfloat16"], [[2]], group_name="weights-0") for i in (0, 1)]
        loads = [await sync.bucket(bucket) for bucket in buckets]
        first, second = await asyncio.wait_for(asyncio.gather(*loads), 30)
        assert first[0].success and not second[0].success
        assert "/update_weights_from_distributed" in second[0].message
        assert sync.attempt is not None and not sync.attempt.aborted.done()
        assert sync.attempt.deadline is not None and not sync.attempt.deadline.cancelled()
    finally:
        if sync.attempt is not None:
            sync.attempt.deadline.cancel()
        await pool.close()
        await engine.server.close()


class LateFailingEngine(FakeEngine):
    """Its receive of a bucket fails after `delay` seconds, as a receive whose sender is gone does (later on a loaded
    host, where one engine hears it a second or more after another)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/update_weights_from_distributed":
            await asyncio.sleep(self.delay)
            return web.json_response({"success": False, "message": "Connection closed by peer"})
        return await super().handle(request)


@contextlib.asynccontextmanager
async def _first_bucket_posted(engines: list[FakeEngine]):
    """A sync prepared on these engines (in a pool of their own) with its first bucket posted: yields the pool, the
    engines' URLs, the sync and the future of the bucket's results future."""
    pool = EnginePool(RolloutConfig(weight_sync_timeout_s=30))
    urls = [await engine.start() for engine in engines]
    for url in urls:
        await pool.register(url)
    pool.running.set()
    sync = WeightSync(pool.config, pool, Buffer())
    try:
        await sync.prepare(1, SOURCES, "gloo")
        bucket = Bucket(0, ["v1.b0"], ["bfloat16"], [[2]], group_name="weights-0")
        yield pool, urls, sync, asyncio.ensure_future(sync.bucket(bucket))  # unordered engines: once loaded
    finally:
        if sync.attempt is not None and sync.attempt.deadline is not None:
            sync.attempt.deadline.cancel()
        await pool.close()
        for engine in engines:
            await engine.server.close()


@pytest.mark.parametrize("cut", [True, False])
async def test_a_receive_failing_late_after_the_trainers_stream_was_cut_is_no_engines_fault(cut):
    """Every engine's receive of a bucket fails, one more than PEERS_FAIL_S after the other. With the trainer's stream
    cut first (it died mid-broadcast), no engine is at fault and both stay; with the trainer still there, the engine
    that failed first is the one at fault (the other waited on a broadcast it could not complete) and is evicted."""
    engines = [LateFailingEngine(0.1), LateFailingEngine(PEERS_FAIL_S + 1.0)]
    async with _first_bucket_posted(engines) as (pool, urls, sync, loading):
        await asyncio.sleep(0.05)
        if cut:
            sync.stream_ended(cut=True)
        results = await asyncio.wait_for(await loading, 30)
        assert not any(result.success for result in results)
        evicted = [url for url in urls if pool.engines[url].state == EVICTED]
        assert evicted == ([] if cut else urls[:1])


async def test_a_trainer_whose_stream_is_heard_cut_just_after_a_receive_failed_leaves_every_engine_in():
    """The trainer dies mid-broadcast: one engine's receive fails at once, the other's had already arrived, and the
    trainer's stream is heard cut only after that failure (on a loaded host the engine's answer can come first). No
    engine is at fault: the failing one stays, as it would had the cut come first."""
    async with _first_bucket_posted([LateFailingEngine(0.05), FakeEngine()]) as (pool, urls, sync, loading):
        await asyncio.sleep(0.3)  # the failure is in, its engine's liveness checked
        sync.stream_ended(cut=True)
        results = await asyncio.wait_for(await loading, 30)
        assert [result.success for result in results] == [False, True]
        assert not [url for url in urls if pool.engines[url].state == EVICTED]
