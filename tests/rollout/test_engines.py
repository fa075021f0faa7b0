"""The engine pool against real reference engines: registration, routing, retries on another engine, eviction of
an engine killed with SIGKILL, and its re-admission when it comes back."""

import asyncio
import os
import signal
import time

import aiohttp
import grpc
import pytest

from services.common.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from services.rollout.config import RolloutConfig
from services.rollout.engines import EVICTED, HEALTHY, EnginePool
from services.rollout.server import build
from slipstream.v1 import rollout_pb2, rollout_pb2_grpc

FAST = {"rollout_health_check_interval": 0.2, "rollout_health_check_timeout": 5, "request_timeout_s": 30}
BODY = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def test_register_list_deregister_over_grpc(grpc_service, channel_to, start_engine):
    first, second = start_engine.many([(), ()], [None, None])
    running = grpc_service(build, RolloutConfig(engine_urls=[first], **FAST))
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(running.address))
    info = stub.RegisterEngine(rollout_pb2.RegisterEngineRequest(url=second + "/"), timeout=30)
    assert info.state == rollout_pb2.ENGINE_STATE_HEALTHY and info.tp_size == 1 and info.weight_version == "default"
    listed = stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10).engines
    assert sorted(e.url for e in listed) == sorted([first, second])
    with pytest.raises(grpc.RpcError) as again:
        stub.RegisterEngine(rollout_pb2.RegisterEngineRequest(url=second), timeout=10)
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.DeregisterEngine(rollout_pb2.DeregisterEngineRequest(url=first), timeout=10)
    assert [e.url for e in stub.ListEngines(rollout_pb2.ListEnginesRequest()).engines] == [second]
    with pytest.raises(grpc.RpcError) as missing:
        stub.DeregisterEngine(rollout_pb2.DeregisterEngineRequest(url=first), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as bad:
        stub.RegisterEngine(rollout_pb2.RegisterEngineRequest(url="localhost:1"), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "use http://host:port" in bad.value.details()


async def test_requests_spread_and_groups_keep_their_engine(start_engine):
    pool = EnginePool(RolloutConfig(**FAST))
    urls = start_engine.many([(), ()], [None, None])
    for url in urls:
        await pool.register(url)
    used = [engine.url for _, engine in await asyncio.gather(*(pool.generate(BODY) for _ in range(16)))]
    assert set(used) == set(urls)  # least-outstanding routing uses both
    same = {(await pool.generate(BODY, affinity="group-7"))[1].url for _ in range(6)}
    assert len(same) == 1  # one prompt group's samples stay on one engine
    await pool.close()


async def test_a_killed_engine_is_evicted_requests_go_elsewhere_and_it_is_readmitted(start_engine, free_port):
    pool = EnginePool(RolloutConfig(**FAST))
    port = free_port()
    doomed, survivor = start_engine.many([(), ()], [port, None])
    for url in (doomed, survivor):
        await pool.register(url)
    health = asyncio.create_task(pool.check_forever())
    try:
        os.kill(start_engine.procs[doomed].proc.pid, signal.SIGKILL)
        start_engine.procs[doomed].proc.wait()
        answers = await asyncio.gather(*(pool.generate(BODY) for _ in range(8)))
        assert all(engine.url == survivor for _, engine in answers)  # failures were retried on the survivor
        assert all(len(answer["output_ids"]) == 4 for answer, _ in answers)
        await _until(lambda: pool.engines[doomed].state == EVICTED)
        assert pool.engines[doomed].last_error
        start_engine(port=port)  # the same engine comes back
        await _until(lambda: pool.engines[doomed].state == HEALTHY, timeout_s=60)
    finally:
        health.cancel()
        await pool.close()


async def test_an_engine_that_answered_within_the_interval_is_not_health_checked(start_engine):
    """An answer to a request proves an engine healthy: the health round checks only the engines that gave none
    within the last interval, and the answer also clears a failure the engine had before."""
    pool = EnginePool(RolloutConfig(**{**FAST, "rollout_health_check_interval": 30}))
    urls = start_engine.many([(), ()], [None, None])
    for url in urls:
        await pool.register(url)
        pool.engines[url].failures = 1
    assert {e.url for e in pool.due()} == set(urls)
    used = {(await pool.generate(BODY, affinity="group-1"))[1].url for _ in range(3)}
    assert len(used) == 1  # the group's engine
    (idle,) = set(urls) - used
    assert [e.url for e in pool.due()] == [idle]
    assert [pool.engines[url].failures for url in urls] == [0 if url in used else 1 for url in urls]
    pool.engines[used.pop()].answered_at -= 30  # an interval ago: due again
    assert {e.url for e in pool.due()} == set(urls)
    await pool.close()


async def test_no_healthy_engine_and_bad_requests(start_engine):
    pool = EnginePool(RolloutConfig(**FAST))
    with pytest.raises(Unavailable, match="no healthy engine"):
        await pool.generate(BODY)
    url = start_engine()
    await pool.register(url)
    with pytest.raises(AlreadyExists):
        await pool.register(url)
    with pytest.raises(InvalidArgument, match="refused it"):  # a 400 is not retried elsewhere: it is our request
        await pool.generate({"input_ids": [], "sampling_params": {}})
    assert pool.engines[url].state == HEALTHY
    with pytest.raises(NotFound):
        await pool.deregister("http://127.0.0.1:1")
    await pool.close()


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.1)


def test_only_allowed_hosts_may_be_registered_or_named_as_the_weight_groups_master(
    grpc_service, channel_to, start_engine
):
    first, second = start_engine.many([(), ()], [None, None])
    config = RolloutConfig(engine_urls=[first], allowed_engine_hosts=["10.0.0.0/8", "engine-*.svc"], **FAST)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_service(build, config).address))
    for url in (second, "http://192.168.0.7:30000", "http://evil.example:30000", "http://engine-1.svc.evil:1"):
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterEngine(rollout_pb2.RegisterEngineRequest(url=url), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (
            "not allowed by the gateway's --allowed-engine-hosts (10.0.0.0/8, engine-*.svc)" in refused.value.details()
        )
    assert [e.url for e in stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10).engines] == [first]
    for address in ("192.168.0.7", "evil.example"):  # the default list: this machine only
        request = rollout_pb2.PrepareWeightSyncRequest(version=1, master_address=address, master_port=1, backend="gloo")
        with pytest.raises(grpc.RpcError) as refused:
            stub.PrepareWeightSync(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--allowed-weight-sync-hosts (127.0.0.0/8, ::1, localhost)" in refused.value.details()


def test_a_registered_engine_is_allowed_by_a_host_pattern(grpc_service, channel_to, start_engine):
    first, second = start_engine.many([(), ()], [None, None])
    config = RolloutConfig(engine_urls=[first], allowed_engine_hosts=["127.0.0.*"], **FAST)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel_to(grpc_service(build, config).address))
    stub.RegisterEngine(rollout_pb2.RegisterEngineRequest(url=second), timeout=30)
    assert len(stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10).engines) == 2


async def test_engines_with_an_api_key_are_called_with_it(start_engine, tmp_path):
    key = "engine-key-" + "k" * 20
    url = start_engine("--api-key", key)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/generate", json=BODY) as response:
            assert response.status == 401  # as SGLang's --api-key
        async with session.get(f"{url}/health") as response:
            assert response.status == 200
    key_file = tmp_path / "engine-key"
    key_file.write_text(key + "\n")
    pool = EnginePool(RolloutConfig(engine_api_key_file=key_file, **FAST))
    await pool.register(url)
    answer, engine = await pool.generate(BODY)
    assert engine.url == url and answer["meta_info"]["completion_tokens"] == 4
    await pool.close()
    keyless = EnginePool(RolloutConfig(**FAST))
    engine = await keyless.register(url)
    assert engine.state == EVICTED and "401" in engine.last_error
    await keyless.close()
