"""gRPC face of the rollout gateway: translates RolloutService requests to the engine pool, the rollout workers,
evaluation and the weight-sync control plane, and back."""

import asyncio
import logging

import grpc

from services.common.clients import Credentials, open_aio_channel
from services.rollout.allowlist import HostList, url_host
from services.rollout.config import RolloutConfig
from services.rollout.engines import DRAINING, EVICTED, HEALTHY, STARTING, Engine, EnginePool, normalize
from services.rollout.evaluation import evaluate
from services.rollout.fleet import reconcile
from services.rollout.weight_sync import WeightSync
from services.rollout.workers import Rollout
from services.weightsync.protocol import Bucket, specs
from slipstream.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_STATES = {
    STARTING: rollout_pb2.ENGINE_STATE_STARTING,
    HEALTHY: rollout_pb2.ENGINE_STATE_HEALTHY,
    EVICTED: rollout_pb2.ENGINE_STATE_EVICTED,
    DRAINING: rollout_pb2.ENGINE_STATE_DRAINING,
}


def engine_info(engine: Engine) -> rollout_pb2.EngineInfo:
    return rollout_pb2.EngineInfo(
        url=engine.url,
        tp_size=engine.tp_size,
        state=_STATES[engine.state],
        weight_version=engine.weight_version,
        num_outstanding_requests=engine.outstanding,
        model_path=engine.model_path,
        last_error=engine.last_error,
    )


def _results(results) -> list[rollout_pb2.EngineResult]:
    return [rollout_pb2.EngineResult(url=r.url, success=r.success, message=r.message) for r in results]


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """With a fleet of gateways, membership and the rollout state go through Redis (every gateway follows them), and
    the weight-sync calls are forwarded to the coordinator, which syncs every engine of the run."""

    def __init__(self, pool: EnginePool, rollout: Rollout, sync: WeightSync, config: RolloutConfig, fleet=None):
        self.pool, self.rollout, self.sync, self.fleet = pool, rollout, sync, fleet
        self.engine_hosts = HostList(config.allowed_engine_hosts, "allowed-engine-hosts")
        self.master_hosts = HostList(config.allowed_weight_sync_hosts, "allowed-weight-sync-hosts")
        self.credentials = Credentials.of(config, "trainer")  # forwarded calls are the trainer's
        self._coordinator_stub: tuple[str, rollout_pb2_grpc.RolloutServiceStub] | None = None
        self.config = config

    def _coordinator(self) -> rollout_pb2_grpc.RolloutServiceStub | None:
        """The coordinator to forward a weight-sync call to; None when this gateway runs the syncs."""
        if self.fleet is None or self.fleet.coordinating:
            return None
        address = self.fleet.coordinator
        if self._coordinator_stub is None or self._coordinator_stub[0] != address:
            stub = rollout_pb2_grpc.RolloutServiceStub(open_aio_channel(address, self.credentials))
            self._coordinator_stub = (address, stub)
        return self._coordinator_stub[1]

    async def _forward(self, method: str, request, context):
        """The coordinator's answer to a call forwarded to it, or None when this gateway runs the syncs. A coordinator
        that does not answer may have died: its lease passes to another gateway within --fleet-ttl-s, and the call
        goes to that one once (or is run here, when it is this one), as the trainer starts a sync over."""
        for last in (False, True):
            if (coordinator := self._coordinator()) is None:
                return None
            try:
                return await getattr(coordinator, method)(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                if last or e.code() != grpc.StatusCode.UNAVAILABLE or not await self._succeeded(context):
                    raise

    async def _succeeded(self, context) -> bool:
        """Waits for the coordinator's lease to pass to another gateway; whether it did in time."""
        dead = self.fleet.coordinator
        deadline = asyncio.get_running_loop().time() + 2 * self.config.fleet_ttl_s
        while self.fleet.coordinator == dead and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.config.fleet_heartbeat_s)
            await self.fleet.beat()
        if self.fleet.coordinator == dead:
            return False
        log.warning("the coordinator %s does not answer; %s took over", dead, self.fleet.coordinator)
        if self.fleet.coordinating:  # it syncs every engine of the run: they join its pool now
            await reconcile(self.fleet, self.pool)
        return True

    async def StartRollout(self, request, context):
        if self.fleet is not None:
            await self.fleet.set_started(True)
        return rollout_pb2.StartRolloutResponse(started=self.rollout.start())

    async def StopRollout(self, request, context):
        if self.fleet is not None:
            await self.fleet.set_started(False)
        await self.rollout.stop(request.abort_in_flight)
        return rollout_pb2.StopRolloutResponse()

    async def RegisterEngine(self, request, context):
        await self.engine_hosts.check(url_host(request.url, "url"), "url")
        if self.fleet is None:
            return engine_info(await self.pool.register(request.url))
        url = normalize(request.url)
        await self.fleet.add(url)
        await reconcile(self.fleet, self.pool)
        return engine_info(self.pool.engines.get(url) or Engine(url))

    async def DeregisterEngine(self, request, context):
        if self.fleet is not None and await self.fleet.remove(normalize(request.url)):
            await reconcile(self.fleet, self.pool)
            return rollout_pb2.DeregisterEngineResponse()
        await self.pool.deregister(request.url)
        return rollout_pb2.DeregisterEngineResponse()

    async def ListEngines(self, request, context):
        return rollout_pb2.ListEnginesResponse(engines=[engine_info(e) for e in self.pool.engines.values()])

    async def Evaluate(self, request, context):
        # With none of its own to evaluate on, the coordinator, which holds every engine, does it.
        generating = self.fleet is None or self.pool.generating()
        if not generating and (answer := await self._forward("Evaluate", request, context)) is not None:
            return answer
        by_name = await evaluate(
            self.rollout, list(request.datasets), request.n_samples_per_prompt, request.sampling_params
        )
        results = []
        for name, metrics in by_name.items():
            metrics = dict(metrics)
            num, mean = int(metrics.pop("num_samples")), metrics.pop("mean_reward")
            log.info("eval %s at step %d: mean reward %.4f over %d samples", name, request.step, mean, num)
            results.append(rollout_pb2.EvalResult(dataset=name, num_samples=num, mean_reward=mean, metrics=metrics))
        return rollout_pb2.EvaluateResponse(results=results)

    async def PrepareWeightSync(self, request, context):
        sources = [(s.group_name, s.master_address, s.master_port) for s in request.sources] or [
            (request.group_name or "weight_update_group", request.master_address, request.master_port)
        ]
        for _, address, _ in sources:
            await self.master_hosts.check(address, "master_address")
        if (answer := await self._forward("PrepareWeightSync", request, context)) is not None:
            return answer
        prepared = await self.sync.prepare(
            request.version,
            sources,
            request.backend or "nccl",
            request.transport,
            request.delta,
            request.delta_base_version,
            tuple(specs(b.tensors) for b in request.plan),
        )
        engines = [rollout_pb2.EngineRank(url=u, rank_offset=o, tp_size=t) for u, o, t in prepared.ranks]
        return rollout_pb2.PrepareWeightSyncResponse(
            world_size=prepared.world_size,
            engines=engines,
            group_created=prepared.created,
            transport=prepared.transport,
            delta_base_version=prepared.delta_base,
            plan_taken=prepared.plan_taken,
        )

    async def SyncWeightBuckets(self, request_iterator, context):
        if (coordinator := self._coordinator()) is not None:
            async for result in coordinator.SyncWeightBuckets(request_iterator, timeout=context.time_remaining()):
                yield result
            return
        # Delivery runs apart from the answers, which go back in the buckets' order: the next bucket goes to the
        # engines while this one loads and its answer is written.
        answers: asyncio.Queue = asyncio.Queue()
        delivery = asyncio.create_task(self._deliver(aiter(request_iterator), context, answers))
        cut = True
        try:
            while (answer := await answers.get()) is not None:
                bucket, loading = answer
                results, committed = await loading, False
                if bucket.commit and all(r.success for r in results):  # the commit in this answer's round trip
                    # Shielded: a trainer gone meanwhile does not cut a commit short, as the group's end does not.
                    results, committed = await asyncio.shield(self.sync.commit(bucket.version)), True
                yield rollout_pb2.WeightBucketResult(
                    bucket_index=bucket.bucket_index, engines=_results(results), committed=committed
                )
            await delivery  # its error, if it ended on one
            cut = False
        finally:  # a trainer that died mid-stream ends it like one that is done: it must commit or prepare soon
            delivery.cancel()
            self.sync.stream_ended(cut)

    async def _deliver(self, requests, context, answers: asyncio.Queue) -> None:
        """Each bucket the trainer sends, to the engines in turn; the next one is read while one loads."""
        following = asyncio.ensure_future(anext(requests, None))
        try:
            while (bucket := await self._next_bucket(following, context)) is not None:
                following = asyncio.ensure_future(anext(requests, None))
                loading = await self.sync.bucket(
                    Bucket(
                        bucket.bucket_index,
                        *specs(bucket.tensors),
                        bucket.load_format,
                        tuple(bucket.serialized_named_tensors),
                        bucket.group_name,
                        bucket.num_buckets,
                        tuple(specs(b.tensors) for b in bucket.plan),
                        bucket.commit,
                        bucket.planned,
                    )
                )
                answers.put_nowait((bucket, loading))
        finally:
            answers.put_nowait(None)
            if not following.cancel() and not following.cancelled():
                following.exception()  # read: a stream that broke while a bucket loaded is no unread error

    async def _next_bucket(self, following: asyncio.Future, context):
        """The trainer's next bucket (None at the end), being read by `following`; a sync the gateway aborts
        meanwhile ends the stream with ABORTED, so that a trainer waiting on it hears at once."""
        aborted = self.sync.attempt.aborted if self.sync.attempt is not None else None
        if aborted is not None and not following.done():  # a bucket already read goes on at once
            await asyncio.wait({following, aborted}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                await context.abort(grpc.StatusCode.ABORTED, f"the weight sync was aborted: {aborted.result()}")
        return await following

    async def CommitWeightSync(self, request, context):
        if (answer := await self._forward("CommitWeightSync", request, context)) is not None:
            return answer
        return rollout_pb2.CommitWeightSyncResponse(engines=_results(await self.sync.commit(request.version)))

    async def AbortWeightSync(self, request, context):
        if (answer := await self._forward("AbortWeightSync", request, context)) is not None:
            return answer
        await self.sync.abort(request.version, request.reason)
        return rollout_pb2.AbortWeightSyncResponse()

    async def ReleaseEngineMemory(self, request, context):
        if (answer := await self._forward("ReleaseEngineMemory", request, context)) is not None:
            return answer
        return rollout_pb2.ReleaseEngineMemoryResponse(engines=_results(await self.sync.release()))
