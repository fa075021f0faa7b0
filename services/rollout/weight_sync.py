"""The gateway's side of weight sync (docs/rollout.md; SGLang's routes: docs/sglang_api.md): it sets up the process
group between the trainer (rank 0) and every engine's TP ranks (or the weight receiver beside each engine), pauses
generation, delivers each bucket to all engines at once while the trainer sends it, then commits the version
(engines, generation, buffer). How buckets travel is the transport's (services/rollout/transports), chosen at each
Prepare.

A trainer with pipeline stages has a sender per stage, each rank 0 of its own group with every engine (the sources).
Their buckets reach the engines one at a time, in the order they arrive here, the same order on every engine: an
engine receives one broadcast at a time, and two engines taking two groups' buckets in opposite orders would each
wait for the other.

Every engine call has a deadline; an engine that fails is evicted and the sync goes on with the others. The group is
kept across syncs and rebuilt only when the engines taking part change.
"""

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.rollout.config import RolloutConfig
from services.rollout.engines import EVICTED, Engine, EngineFailure, EnginePool, EngineTimeout
from services.weightsync.factory import gateway_half
from services.weightsync.halves import Gateway
from services.weightsync.protocol import BACK, GATEWAY_MOVES, Bucket, GatewayPhase
from slipstream.v1 import buffer_pb2, rollout_pb2

log = logging.getLogger(__name__)

SESSION_VERSION = (0, 5, 21)  # SGLang from this version needs begin/end_weight_update around updates
STREAM_END_GRACE_S = 15.0  # after its bucket stream, a trainer commits (or prepares again) within this
PEERS_FAIL_S = 1.0  # a bucket failed on an engine: the others' receives that fail within this failed with it
# They time out when others fail (a member that left, a trainer that stopped sending), not by the engine's fault.
WAITS_FOR_PEERS = {"/init_weights_update_group", "/update_weights_from_distributed", "/receive_weights"}


@dataclass
class Group:
    members: tuple  # ((engine url, ranks), ...) in rank order
    sources: tuple  # ((group name, master address, port), ...): one group per sender
    backend: str  # the group's collective backend (nccl, gloo)
    transport: str = ""  # a group is rebuilt for another transport (its members are others)
    admissions: tuple = ()  # each member's admission count: a re-admitted engine needs a new group
    # The bucket whose failure took the group down; the others in flight failed because of it, not of their engines.
    broken_by: int | None = field(default=None, compare=False)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.sources]

    @property
    def world_size(self) -> int:
        return 1 + sum(ranks for _, ranks in self.members)

    def offsets(self) -> list[int]:
        """Each member's first rank (the sender is rank 0)."""
        return [1 + sum(ranks for _, ranks in self.members[:i]) for i in range(len(self.members))]


@dataclass
class Attempt:
    """The gateway's side of one sync (of one version, started over by a Prepare of that version after an engine
    left). It lives from the first Prepare to the commit or the abort, and everything of the sync with it."""

    version: int
    aborted: asyncio.Future  # resolves with the reason when the sync is aborted (a trainer on its stream hears it)
    phase: GatewayPhase = GatewayPhase.PREPARED
    before: GatewayPhase = GatewayPhase.PREPARED  # what a failed commit returns to
    joining: asyncio.Task | None = None  # the engines joining the groups, awaited by the first bucket or the commit
    planned: asyncio.Task | None = None  # the plan that came with Prepare, on its way; the sender's stream claims it
    sender_gone: asyncio.Event = field(default_factory=asyncio.Event)  # a sender's stream was cut since the last
    # Prepare: its receives failed with it
    deadline: asyncio.TimerHandle | None = None  # the trainer silent past it is gone: the sync is aborted

    def move(self, event: str) -> None:
        moves = GATEWAY_MOVES.get(self.phase, {})
        if event not in moves:  # a Prepare while the commit is under way: the trainer prepares again after it
            raise FailedPrecondition(f"the weight sync of version {self.version} is {self.phase.value}: no {event} now")
        after = moves[event]
        if after is GatewayPhase.COMMITTING and self.phase is not GatewayPhase.COMMITTING:
            self.before = self.phase
        elif event == "loaded" and self.phase is GatewayPhase.COMMITTING:
            self.before = GatewayPhase.LOADING
        self.phase = self.before if after is BACK else after

    @property
    def partial(self) -> bool:
        """Engines hold part of it: generation waits for a complete sync."""
        return GatewayPhase.LOADING in (self.phase, self.before)


@dataclass(frozen=True)
class Prepared:
    """A Prepare's answer (PrepareWeightSyncResponse)."""

    world_size: int
    ranks: list[tuple[str, int, int]]  # (engine url, rank offset, ranks) of each member
    created: bool  # the senders must join new groups
    transport: int  # the WeightTransport chosen
    delta_base: int  # the delta's base version, or 0
    plan_taken: bool  # the plan that came with Prepare is on its way to the receivers


@dataclass
class Result:
    url: str
    success: bool
    message: str


class WeightSync:
    def __init__(self, config: RolloutConfig, pool: EnginePool, buffer, fleet=None):
        self.config, self.pool, self.buffer = config, pool, buffer
        self.fleet = fleet  # of gateway replicas: the others learn there that the engines are paused for a sync
        self.group: Group | None = None  # None once a member left: the next Prepare builds a new one
        self.engines: list[Engine] = []  # taking part in the current attempt
        self.attempt: Attempt | None = None  # the open sync
        self.released = False  # colocated: the engines gave their GPU memory to the trainer
        self.delivering = asyncio.Lock()  # buckets reach the engines in turn, whichever sender sent them
        self.deliveries: set[asyncio.Future] = set()  # buckets being loaded: a Prepare waits for them (below)
        self.transport: Gateway = gateway_half(rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED, [], config)  # of the open sync

    @property
    def version(self) -> int | None:
        """Of the open sync."""
        return None if self.attempt is None else self.attempt.version

    @property
    def committing(self) -> bool:
        return self.attempt is not None and self.attempt.phase is GatewayPhase.COMMITTING

    async def prepare(
        self,
        version: int,
        sources: list[tuple[str, str, int]],
        backend: str,
        asked: int = rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED,
        delta: bool = False,
        delta_base: int = 0,
        plan=(),
    ) -> "Prepared":
        """`sources`: (group name, master address, port) of each sender; `backend`: a weight group's collective backend;
        `asked`: the WeightTransport the trainer asks for; `delta`: the senders send deltas against version `delta_base`
        where every engine holds it; `plan`: a lone sender's whole plan (each bucket's names, dtypes, shapes), delivered
        at once where the sync streams over a group already joined. Called again with the same version after an engine
        left, it starts the sync over with the engines still healthy."""
        if len({name for name, _, _ in sources}) != len(sources):
            raise InvalidArgument("sources", f"each sender needs its own group_name, got {[n for n, _, _ in sources]}")
        kind = gateway_half(asked, [], self.config, self.pool.adapters)  # refuses one not set up here, before pausing
        attempt, again = await self._open_attempt(version)
        try:
            self._watch(0)
            await self._settle(attempt, again)
            engines = await self._take_part(attempt, kind)
            transport = gateway_half(asked, engines, self.config, self.pool.adapters)
            group, created = await self._group_for(attempt, engines, sources, backend, transport)
            transport.open(version, group.names)
            base = self._delta_base(transport, engines, created, delta, delta_base, version)
            self.engines, self.transport = engines, transport
            await self._ready(engines, transport)
            if plan and transport.streamed and not created and len(sources) == 1:  # it runs once Prepare answered
                attempt.planned = asyncio.ensure_future(self._deliver_plan(attempt, plan, self.group))
            offsets = group.offsets()
            ranks = [(url, offset, n) for (url, n), offset in zip(group.members, offsets, strict=True)]
            return Prepared(group.world_size, ranks, created, transport.kind, base, attempt.planned is not None)
        finally:  # armed whatever happened here: a trainer silent past it is gone, and the sync is aborted
            self._watch()

    async def _open_attempt(self, version: int) -> tuple[Attempt, bool]:
        """The attempt of `version`, and whether it is one started over (an engine left): another version's open sync
        is aborted first (its trainer is gone, and a new one starts over)."""
        if self.version is not None and self.version != version:
            await self.abort(self.version, f"PrepareWeightSync of version {version} arrived before it ended")
        again = self.attempt is not None
        if not again:
            self.attempt = Attempt(version, asyncio.get_running_loop().create_future())
        self.attempt.move("prepare")
        self.attempt.sender_gone.clear()
        return self.attempt, again

    async def _settle(self, attempt: Attempt, again: bool) -> None:
        """What the last Prepare left behind ends first: its unclaimed plan (whose receives wait in vain), buckets still
        loading (a trainer that heard of a failed bucket prepares again at once; the one whose failure took the group
        down evicts the engine at fault once it ends), and a group the trainer could not join."""
        if attempt.planned is not None:
            planned, attempt.planned = attempt.planned, None
            if not planned.done() and self.group is not None:
                await self._break("prepare", [])
            await asyncio.wait({planned})
        if self.deliveries:
            await asyncio.wait(set(self.deliveries))
        if again and self.group is not None:
            if attempt.joining is not None:
                attempt.joining.cancel()
            await self._break("joining", [])

    async def _take_part(self, attempt: Attempt, kind: Gateway) -> list[Engine]:
        """The engines that take part: paused (a failed control call evicts a dead member, which would stall the
        group) or probed; none healthy ends the sync."""
        await self._mark_syncing(True)
        if self.pool.running.is_set() and kind.pauses:
            await self.pool.pause(self.config.pause_mode)
        else:
            await asyncio.gather(*(self._probe(e) for e in self.pool.healthy()))
        engines = self.pool.healthy()
        if not engines:  # the pool goes on (its health checks pause with it): a restarted engine is re-admitted
            self._end(attempt, "abort")
            await self.pool.resume()
            raise Unavailable("no healthy engine to send weights to; register one (RegisterEngine) first")
        return engines

    async def _group_for(
        self, attempt: Attempt, engines: list[Engine], sources: list, backend: str, transport: Gateway
    ) -> tuple[Group, bool]:
        """The sync's group of `engines` and whether it is a new one, which the senders must join: the last one where
        nothing changed; colocated, tensors travel as handles and no group is built."""
        members = tuple((e.url, transport.member(e)[1]) for e in engines)
        group = Group(members, tuple(sources), backend, transport.name, tuple(e.admissions for e in engines))
        created = self.group != group and transport.uses_group
        if not transport.uses_group:
            self.group = group
        if created:
            if self.group is not None:  # its members, by the transport that built it
                await self._destroy(self._members())
                hosted = {(address, port) for _, address, port in self.group.sources}
                if any((address, port) in hosted for _, address, port in group.sources):
                    await self._rehost(group)
            self.group, self.transport = group, transport
            # An engine may still hold a group of these names (it joined one whose trainer failed to host it, and was
            # left out of the teardown): joining again under a held name fails, so each name goes first.
            await self._destroy(engines)
            # Each engine's call returns only once the sender has joined too: it runs while Prepare answers.
            attempt.joining = asyncio.create_task(self._join(engines, group.offsets(), group.world_size))
        return self.group, created

    @staticmethod
    def _delta_base(
        transport: Gateway, engines: list[Engine], created: bool, delta: bool, delta_base: int, version: int
    ) -> int:
        """The version the senders send changes against: every receiver's copy of the last version all engines took,
        where the group is the last one; 0 (every bucket whole) otherwise."""
        if not (delta and transport.streamed):
            return 0
        same = not created and all(e.weight_version == str(delta_base) for e in engines)
        base = delta_base if same else 0
        transport.delta = {"version": version, "base_version": base}
        return base

    async def _ready(self, engines: list[Engine], transport: Gateway) -> None:
        """The engines made ready to take the weights: released memory back (to be overwritten in place), and a weight
        update session begun where the transport pauses them."""
        if self.released:
            await self._each(engines, "/resume_memory_occupation", {"tags": ["weights"]})
        if transport.pauses:
            await self._each(_sessions(engines), "/begin_weight_update", {"selector": "all"})

    async def _rehost(self, group: Group) -> None:
        """The engines taking part changed, and a sender offers the port of its old group: it must host the new one
        on a new port (the old group's store may still hold that port, or another process may have taken it since
        it was let go, and the engines would join whatever listens there). The senders prepare again, each on a new
        port; a trainer that does not is waited out, and generation resumes."""
        was = {url for url, _ in self.group.members}
        now = {url for url, _ in group.members}
        changes = [f"{url} joined" for url in sorted(now - was)] + [f"{url} left" for url in sorted(was - now)]
        self.group = None
        self._watch()
        raise FailedPrecondition(
            f"the engines taking part changed ({', '.join(changes) or 'an engine was re-admitted'}): each sender "
            "hosts a new weight group on a new port; prepare again"
        )

    async def bucket(self, bucket: Bucket) -> asyncio.Future:
        """Delivers one bucket of the sender of `bucket.group_name` ("": the first) to every engine at once, and
        returns once it is on its way: a future of the results, once each engine has loaded it or failed. An ordered
        transport posts the next bucket at once, while the engines still receive or load this one; others once
        every engine answered this one. After a failure the groups are gone (a collective needs all its members):
        the senders prepare again and send from the start."""
        async with self.delivering:
            self._check_open()
            self._watch(0)
            await self._mark_syncing(True)
            if bucket.plan and not self.transport.streamed:
                raise InvalidArgument(
                    "plan",
                    f"a whole plan in one message is for streamed syncs; this one is {self.transport.name}: send "
                    "each bucket's tensors",
                )
            if bucket.commit and (not (bucket.plan or bucket.planned) or len(self.group.sources) > 1):
                raise InvalidArgument(
                    "commit",
                    "only a lone sender's whole plan commits with its answer; with several senders, or buckets sent "
                    "a message each, call CommitWeightSync once every sender is done",
                )
            group_name = bucket.group_name or self.group.names[0]
            if group_name not in self.group.names:
                raise InvalidArgument("group_name", f"{group_name!r} is none of this sync's groups {self.group.names}")
            if bucket.planned:
                loading = self._claim_plan()
            else:
                request = self.transport.requests(self.engines, dataclasses.replace(bucket, group_name=group_name))
                if request is None:  # delivered with a later one: answered now
                    self._watch()
                    done = asyncio.get_running_loop().create_future()
                    done.set_result([Result(e.url, True, "planned") for e in self.engines])
                    return done
                not_joined = await self._joined()
                loading = asyncio.ensure_future(
                    self._deliver(self.attempt, bucket.index, self.group, *request, not_joined)
                )
            if loading.done():  # a plan delivered before the trainer asked: the deadline runs again
                self._watch()
                return loading
            self.deliveries.add(loading)
            loading.add_done_callback(self.deliveries.discard)
            if not self.transport.ordered:
                await asyncio.wait({loading})
            return loading

    async def _deliver_plan(self, attempt: Attempt, plan, group: Group) -> list[Result]:
        """A lone sender's whole plan that came with its Prepare, to every receiver at once: they post their first
        receives while the trainer hears the answer and opens its stream, whose `planned` bucket claims the results.
        Unclaimed, it counts as no delivery: the trainer's deadline runs."""
        bucket = Bucket(0, [], [], [], group_name=group.names[0], num_buckets=len(plan), plan=plan)
        path, bodies = self.transport.requests(self.engines, bucket)
        return await self._deliver(attempt, 0, group, path, bodies, [])

    def _claim_plan(self) -> asyncio.Future:
        attempt = self.attempt
        if attempt.planned is None:
            raise InvalidArgument(
                "planned", "no plan came with this sync's PrepareWeightSync (plan_taken unset): send the plan"
            )
        loading, attempt.planned = attempt.planned, None
        return loading

    async def _deliver(
        self, attempt: Attempt, index: int, group: Group, path: str, bodies: dict, not_joined: list
    ) -> list[Result]:
        results, blamed = (not_joined, None) if not_joined else await self._load_everywhere(index, path, bodies, group)
        if any(r.success for r in results) and attempt is self.attempt:
            attempt.move("loaded")
        if not all(r.success for r in results) and self.group is group and group.broken_by in (None, index):
            group.broken_by = index
            await self._break(f"bucket {index}", results, blamed)
        self._watch()
        return results

    async def _load_everywhere(self, index: int, path: str, bodies: dict, group: Group) -> tuple[list, set | None]:
        """Posts a bucket to every engine (its body in `bodies`, or why it cannot take the bucket). Once one fails,
        the others' receives still pending PEERS_FAIL_S later are cancelled (destroying the group): a broadcast needs
        every member, so theirs may never arrive. Returns the results and, when that happened, the engines that failed
        first (the others failed because of them)."""

        async def load(engine: Engine) -> Result:
            body = bodies[engine.url]
            if isinstance(body, str):
                return Result(engine.url, False, body)
            return await self._call(engine, path, body, self.transport.target(engine))

        tasks = {asyncio.create_task(load(e)): e for e in self.engines}
        pending, first = set(tasks), None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = {t.result().url for t in done if not t.result().success}
            if failed and first is None and pending and self.transport.uses_group:
                if group.broken_by is None:
                    group.broken_by = index
                # A member that died (the trainer) fails every receive within moments, and no engine is to blame; an
                # engine at fault leaves the others waiting on a broadcast that cannot complete: they are let go, and
                # the engines that failed by then are the suspects.
                more, pending = await asyncio.wait(pending, timeout=PEERS_FAIL_S)
                if pending:
                    first = failed | {t.result().url for t in more if not t.result().success}
                    await self._destroy([tasks[t] for t in pending], group)
        return [t.result() for t in tasks], first

    async def commit(self, version: int) -> list[Result]:
        self._check_open(version)
        self._watch(0)
        attempt = self.attempt
        attempt.move("commit")
        try:
            return await self._commit(version)
        finally:  # a commit that failed leaves the sync open: the trainer prepares again, or is waited out
            if attempt is self.attempt and attempt.phase is GatewayPhase.COMMITTING:
                attempt.move("failed")
                self._watch()

    async def _commit(self, version: int) -> list[Result]:
        failed = await self._joined()
        if failed:
            await self._break("commit", failed)
            raise FailedPrecondition(f"engines left the weight sync of version {version}; prepare it again")
        loads = self.transport.loads(self.engines, version)
        loaded = []
        if loads is not None:  # an engine that cannot load it is evicted (a later sync re-admits it)
            loaded = (await self._load_everywhere(-1, *loads, self.group))[0]
            for result in (r for r in loaded if not r.success):
                self.pool.evict(self.pool.engines[result.url], f"weight sync of version {version}: {result.message}")
        body = {"new_version": str(version), "abort_all_requests": False}
        # Independent calls, at once. A buffer that is restarting (its state is in Redis) is waited for: it must
        # learn the version before generation goes on under it, or synchronous training would wait forever.
        request = buffer_pb2.SetPolicyVersionRequest(version=version)
        labels = self.transport.pauses  # an adapter leaves the engines' own version (their base weights') alone
        labelling = labels and not self.transport.labelled  # else the last bucket's load gave them the version
        ended, results, _ = await asyncio.gather(
            self._each(_sessions(self.engines) if labels else [], "/end_weight_update", {}),
            self._each(self.engines if labelling else [], "/update_weight_version", body),
            self.buffer.SetPolicyVersion(request, timeout=self.config.weight_sync_timeout_s, wait_for_ready=True),
        )
        for result in (r for r in ended + results if not r.success):  # its state is unknown: a full sync re-admits it
            reason = f"commit of weight version {version} failed: {result.message}"
            self.pool.evict(self.pool.engines[result.url], reason)
        if labels and not labelling:
            results = [
                Result(e.url, e.state != EVICTED, e.last_error if e.state == EVICTED else "") for e in self.engines
            ]
        results = results if labels else loaded
        self.transport.committed([r.url for r in results if r.success], version)
        for result in (r for r in results if labels and r.success):
            engine = self.pool.engines[result.url]
            if engine.state != EVICTED:  # not one whose session failed to end (evicted above: unversioned)
                self.pool.serves(engine, str(version))
        self._end(self.attempt, "committed")
        await self._reclaim()
        if labels:
            await self.pool.resume()
        self.pool.committed.set()
        await self._mark_syncing(False)
        log.info("weights of version %d are live on %d engine(s)", version, sum(r.success for r in results))
        return results

    async def abort(self, version: int, reason: str) -> None:
        """Ends the open sync: engines keep their version; the next sync builds a new group. Engines that loaded part
        of it stay paused until a sync completes, so no sample is generated by weights of no version."""
        if self.version is None or version != self.version:
            return
        attempt = self.attempt
        log.warning("weight sync of version %d aborted: %s", version, reason or "no reason given")
        if not attempt.aborted.done():  # a trainer waiting on its bucket stream hears it
            attempt.aborted.set_result(reason or "aborted")
        if attempt.joining is not None:
            attempt.joining.cancel()
        if self.group is not None:
            group, self.group = self.group, None
            await self._leave(self.engines, group)
        if attempt.planned is not None:  # its receives ended with the group
            await asyncio.wait({attempt.planned})
        partial = attempt.partial
        self._end(attempt, "abort")
        if partial:
            log.warning("engines hold part of version %d: generation waits for the next complete sync", version)
        else:
            await self._reclaim()
            await self.pool.resume()
            await self._mark_syncing(False)

    async def _mark_syncing(self, syncing: bool) -> None:
        """Tells the other gateways of the fleet that the engines are paused for a sync (their health checks hold
        off); the mark expires should this gateway die meanwhile."""
        if self.fleet is not None:
            await self.fleet.set_syncing(syncing, 2 * self.config.weight_sync_timeout_s)

    async def release(self) -> list[Result]:
        """Colocated training: generation pauses and the engines free their GPU memory; the next commit takes it
        back (weights at Prepare, the KV cache at Commit) and generation continues."""
        if self.pool.running.is_set():
            await self.pool.pause(self.config.pause_mode)
        results = await self._each(self.pool.healthy(), "/release_memory_occupation", {"tags": None})
        self.released = True
        return results

    async def _reclaim(self) -> None:
        if self.released:
            await self._each(self.pool.healthy(), "/resume_memory_occupation", {"tags": None})
            self.released = False

    # Plumbing

    def _check_open(self, version: int | None = None) -> None:
        if self.version is None or (version is not None and version != self.version):
            raise FailedPrecondition(
                f"no weight sync of version {version or '?'} is open; call PrepareWeightSync first"
            )
        if self.group is None:
            raise FailedPrecondition(
                f"an engine left the weight sync of version {self.version}; call PrepareWeightSync again"
            )

    def _end(self, attempt: Attempt, event: str) -> None:
        """The attempt ends (`event`: committed or abort), and everything of it with it."""
        attempt.move(event)
        if attempt.deadline is not None:
            attempt.deadline.cancel()
        if self.attempt is attempt:
            self.attempt = None

    def stream_ended(self, cut: bool = False) -> None:
        """The trainer's bucket stream ended (`cut`: before its end, the trainer gone): a live trainer commits or
        prepares again at once (its commit may come in before the stream's end is heard, and is not cut short)."""
        if cut and self.attempt is not None:  # the receives it broadcast to fail by its fault, however late
            self.attempt.sender_gone.set()
        if self.version is not None and not self.committing:
            self._watch(STREAM_END_GRACE_S)

    def _watch(self, timeout: float | None = None) -> None:
        """(Re)arms the sync's deadline after each answer: a trainer silent for that long is gone, and the sync is
        aborted. 0 disarms it. A trainer waiting for a bucket's answer is silent by right: while one is delivered
        the deadline waits, and the last delivery to end arms it."""
        attempt = self.attempt
        if attempt is None:
            return
        if attempt.deadline is not None:
            attempt.deadline.cancel()
        timeout, version = self.config.weight_sync_timeout_s if timeout is None else timeout, attempt.version
        if not timeout or self.deliveries - {asyncio.current_task()}:
            return
        reason = f"no word from the trainer for {timeout:.0f} s"
        attempt.deadline = asyncio.get_running_loop().call_later(
            timeout, lambda: asyncio.create_task(self.abort(version, reason))
        )

    async def _break(self, where: str, results: list[Result], first: set[str] | None = None) -> None:
        """An engine failed: evict the engines at fault and take the group down on the others. When an engine died
        or every engine failed at once, the live ones that failed only lost their peer (or the trainer): they stay.
        `first`: the engines that failed before the others' receives were cancelled (only they can be at fault)."""
        group, self.group = self.group, None  # once: a bucket still in flight fails too, and finds it gone
        failed = [self.pool.engines[r.url] for r in results if not r.success and r.url in self.pool.engines]
        alive = await asyncio.gather(*(self.pool.alive(e) for e in failed))
        dead = [e for e, ok in zip(failed, alive, strict=True) if not ok]
        suspects = failed if first is None else [e for e in failed if e.url in first]
        attempt = self.attempt
        if suspects and not dead and len(suspects) < len(self.engines) and attempt is not None:
            # A trainer that died failed them too, and its stream's cut may be heard a moment after their failures
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(attempt.sender_gone.wait(), PEERS_FAIL_S)
        if attempt is not None and attempt.sender_gone.is_set():  # an engine slow to hear it is not at fault
            suspects = []
        at_fault = dead or ([] if len(suspects) == len(self.engines) else suspects)
        messages = {r.url: r.message for r in results}
        for engine in at_fault:
            self.pool.evict(engine, f"weight sync of version {self.version} failed at {where}: {messages[engine.url]}")
        on = ", ".join(f"{e.url} ({messages[e.url]})" for e in failed) or "the trainer's side (it prepares again)"
        log.warning("weight sync of version %d: %s failed on %s; the trainer starts over", self.version, where, on)
        await self._leave([e for e in self.engines if e not in at_fault], group)

    async def _leave(self, engines: list[Engine], group: Group) -> None:
        if self.transport.streamed:  # a receiver mid-sync holds its engine (SGLang runs the update on its scheduler)
            await self._destroy(engines, group)
            await self._each(_sessions(engines), "/end_weight_update", {})
            return
        await self._each(_sessions(engines), "/end_weight_update", {})
        if self.transport.uses_group:
            await self._destroy(engines, group)

    async def _join(self, engines: list[Engine], offsets: list[int], world_size: int) -> list[Result]:
        """Each engine joins every sender's group, in the sources' order (as each sender waits in its own)."""

        async def join(engine: Engine, offset: int) -> Result:
            for name, address, port in self.group.sources:
                body = {
                    "master_address": address,
                    "master_port": port,
                    "world_size": world_size,
                    "group_name": name,
                    "backend": self.group.backend,
                    "rank_offset": offset,
                }
                result = await self._call(engine, "/init_weights_update_group", body, self.transport.member(engine)[0])
                if not result.success:
                    return result
            return result

        return list(await asyncio.gather(*(join(e, o) for e, o in zip(engines, offsets, strict=True))))

    async def _destroy(self, engines: list[Engine], group: Group | None = None) -> None:
        """Each engine leaves the groups (its member: the engine, or its receiver)."""
        for name in (group or self.group).names:
            body = {"group_name": name}
            await asyncio.gather(
                *(self._call(e, "/destroy_weights_update_group", body, self.transport.member(e)[0]) for e in engines)
            )

    def _members(self) -> list[Engine]:
        return [self.pool.engines[url] for url, _ in self.group.members if url in self.pool.engines]

    async def _probe(self, engine: Engine) -> None:
        if not await self.pool.alive(engine):
            self.pool.evict(engine, "it does not answer /health")

    async def _joined(self) -> list[Result]:
        """Waits for the group to be formed; returns the failures of engines that could not join."""
        attempt = self.attempt
        if attempt is None or attempt.joining is None:
            return []
        results, attempt.joining = await attempt.joining, None
        return [r for r in results if not r.success]

    async def _each(self, engines: list[Engine], path: str, body: dict, per_engine: dict | None = None) -> list[Result]:
        """Posts `body` (or `per_engine[url]`) to every engine concurrently, each call with the sync's deadline."""
        calls = [self._call(e, path, (per_engine or {}).get(e.url, body)) for e in engines]
        return list(await asyncio.gather(*calls))

    async def _call(self, engine: Engine, path: str, body: dict, url: str | None = None) -> Result:
        """One control call (to `url`, the engine's receiver, where given). A hung engine (stopped, stuck) holds a
        call until its deadline: it is evicted then, and no later call of the sync waits for it again (the trainer's
        deadline for each RPC allows one such wait)."""
        if engine.state == EVICTED:
            return Result(engine.url, False, f"{path}: not sent, the engine is evicted ({engine.last_error})")
        try:
            reply = await self.pool.post_control(engine, path, body, self.config.weight_sync_timeout_s, url)
        except EngineTimeout as e:
            if path not in WAITS_FOR_PEERS:  # a call it answers by itself
                self.pool.evict(engine, f"{path}: {e} (hung?)")
            return Result(engine.url, False, f"{path}: {e}")
        except EngineFailure as e:
            return Result(engine.url, False, f"{path}: {e}")
        reply = reply if isinstance(reply, dict) else {}  # memory calls answer `null`
        return Result(engine.url, bool(reply.get("success", True)), str(reply.get("message", "")))


def _sessions(engines: list[Engine]) -> list[Engine]:
    return [e for e in engines if _version(e.version) >= SESSION_VERSION]


def _version(text: str) -> tuple:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)
