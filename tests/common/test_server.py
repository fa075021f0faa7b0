"""The shared server lifecycle: health, reflection, status-code mapping, metrics, and a busy port."""

import asyncio
import gc
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common.clients import health_status
from services.common.config import ServiceConfig
from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, StartupError
from services.common.server import GrpcServer, Service, Servicer, run_service
from slipstream.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc


class FailingTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    async def GetStatus(self, request, context):
        raise InvalidArgument("step", "must be >= 0; pass a non-negative step")

    async def SaveCheckpoint(self, request, context):
        raise ValueError("disk on fire")

    async def Stop(self, request, context):
        raise NotFound("no run named x")


class FailingRollout(rollout_pb2_grpc.RolloutServiceServicer):
    async def ListEngines(self, request, context):  # calls a service that is down
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            await trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)

    async def SyncWeightBuckets(self, request_iterator, context):
        async for bucket in request_iterator:
            if bucket.bucket_index == 1:
                raise ResourceExhausted("bucket 1 is too large")
            yield rollout_pb2.WeightBucketResult(bucket_index=bucket.bucket_index)


async def build_trainer(config):
    """A service whose servicer implements no RPC (the generated base class)."""
    return Service("plain", config, [Servicer.of(trainer_pb2_grpc.TrainerServiceServicer())])


async def build_failing(config):
    return Service("failing", config, [Servicer.of(FailingTrainer()), Servicer.of(FailingRollout())])


def config(**kw):
    return ServiceConfig(host="127.0.0.1", port=0, **kw)


def test_health_and_reflection(grpc_service, channel_to):
    address = grpc_service(build_trainer, config()).address
    channel = channel_to(address)
    assert health_status(channel) == "SERVING"
    assert health_status(channel, "slipstream.v1.TrainerService") == "SERVING"
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"slipstream.v1.TrainerService", "grpc.health.v1.Health"} <= services


def test_rpcs_a_servicer_lacks_answer_unimplemented(grpc_service, channel_to):
    stub = trainer_pb2_grpc.TrainerServiceStub(channel_to(grpc_service(build_trainer, config()).address))
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "GetStatus" in info.value.details()


def test_domain_errors_become_status_codes(grpc_service, channel_to):
    stub = trainer_pb2_grpc.TrainerServiceStub(channel_to(grpc_service(build_failing, config()).address))
    cases = [
        (stub.GetStatus, trainer_pb2.GetStatusRequest(), grpc.StatusCode.INVALID_ARGUMENT, "step: must be >= 0"),
        (stub.Stop, trainer_pb2.StopRequest(), grpc.StatusCode.NOT_FOUND, "no run named x"),
        (
            stub.SaveCheckpoint,
            trainer_pb2.SaveCheckpointRequest(),
            grpc.StatusCode.INTERNAL,
            "ValueError: disk on fire",
        ),
    ]
    for call, request, code, details in cases:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=5)
        assert info.value.code() == code
        assert details in info.value.details()
        assert "Traceback" not in info.value.details()


def test_a_service_that_is_down_downstream_is_unavailable_not_internal(grpc_service, channel_to):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_service(build_failing, config()).address))
    with pytest.raises(grpc.RpcError) as info:
        stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details().startswith("ListEngines: a service it calls answered UNAVAILABLE: ")


def test_errors_in_streams_become_status_codes(grpc_service, channel_to):
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_service(build_failing, config()).address))
    buckets = (rollout_pb2.WeightBucket(bucket_index=i) for i in range(3))
    results = stub.SyncWeightBuckets(buckets, timeout=5)
    assert next(results).bucket_index == 0
    with pytest.raises(grpc.RpcError) as info:
        next(results)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "bucket 1 is too large"


def test_metrics_count_rpcs_by_code(grpc_service, channel_to):
    async def build(cfg):
        return Service("metered", cfg, [Servicer.of(FailingTrainer())])

    running = grpc_service(build, config())
    stub = trainer_pb2_grpc.TrainerServiceStub(channel_to(running.address))
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            stub.Stop(trainer_pb2.StopRequest(), timeout=5)
    with urllib.request.urlopen(f"http://127.0.0.1:{running.server.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    line = 'slipstream_rpc_requests_total{code="NOT_FOUND",method="Stop",service="metered"} 2.0'
    assert line in text


def test_busy_port_is_a_startup_error(grpc_service):
    running = grpc_service(build_trainer, config())
    port = int(running.address.rsplit(":", 1)[1])
    server = GrpcServer(Service("second", config().model_copy(update={"port": port}), []))
    with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
        asyncio.run(server.start())


def test_stop_turns_health_not_serving_and_closes_clients(grpc_service, channel_to):
    closed = []

    async def build(cfg):
        return Service("closing", cfg, [], on_stop=[lambda: closed.append(True)])

    running = grpc_service(build, config())
    channel = channel_to(running.address)
    assert health_status(channel) == "SERVING"
    running.stop()
    assert closed == [True]
    with pytest.raises(grpc.RpcError):
        health_status(channel)


class SlowTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    async def GetStatus(self, request, context):
        await asyncio.sleep(1.0)
        return trainer_pb2.TrainerStatus(step=7)


def test_stop_lets_in_flight_rpcs_finish(grpc_service, channel_to):
    async def build(cfg):
        return Service("slow", cfg, [Servicer.of(SlowTrainer())])

    running = grpc_service(build, config(grace_period_s=5))
    stub = trainer_pb2_grpc.TrainerServiceStub(channel_to(running.address))
    in_flight = stub.GetStatus.future(trainer_pb2.GetStatusRequest(), timeout=10)
    time.sleep(0.3)
    running.stop()
    assert in_flight.result().step == 7


def test_a_service_runs_on_uvloop_with_what_start_made_frozen(monkeypatch):
    seen = {}

    async def build(cfg):
        finished = asyncio.get_running_loop().create_future()

        async def ready():
            seen["loop"] = type(asyncio.get_running_loop()).__module__
            finished.set_result(None)  # the service ends once serving, as a trainer does at its last step

        return Service("loop", cfg, [], ready=ready, finished=finished)

    monkeypatch.setattr("services.common.server.setup_logging", lambda *args: None)  # the tests' logging stays
    assert run_service(build, config()) == 0
    assert seen["loop"].startswith("uvloop")
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
