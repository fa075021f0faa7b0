"""Engines that misbehave in each way the issue names — HTTP 500, malformed JSON, a hang past the request timeout,
a connection cut in the middle of the answer — beside a real reference engine: every request is retried there and
answered, and the misbehaving engine is evicted. And a reward service that is down: groups go back to the buffer."""

import asyncio

import pytest
from aiohttp import web

from services.rollout.config import RolloutConfig
from services.rollout.engines import EVICTED, HEALTHY, EnginePool
from tests.rollout.conftest import assert_groups_come_back

BODY = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


async def _misbehaving_engine(fault: str, port: int) -> tuple[str, web.AppRunner]:
    """A test fixture: answers the pool's info and health calls like an engine, and /generate with `fault`."""

    async def generate(request: web.Request) -> web.StreamResponse:
        if fault == "500":
            return web.Response(status=500, text="CUDA error: an illegal memory access was encountered")
        if fault == "malformed":
            return web.Response(text='{"text": "unterminated', content_type="application/json")
        if fault == "hang":
            await asyncio.sleep(5)  # well past the 1 s request timeout
        response = web.StreamResponse(headers={"Content-Length": "1000"})  # "dies mid-stream": half an answer
        await response.prepare(request)
        await response.write(b'{"text": "half')
        request.transport.close()
        return response

    def answer(value: dict | None):
        async def handler(request: web.Request) -> web.Response:
            return web.Response() if value is None else web.json_response(value)

        return handler

    app = web.Application()
    app.router.add_get("/server_info", answer({"tp_size": 1, "version": "0.5.23"}))
    app.router.add_get("/model_info", answer({"model_path": "m", "weight_version": "default"}))
    app.router.add_get("/health_generate", answer(None))
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


@pytest.mark.parametrize("fault", ["500", "malformed", "hang", "cut"])
async def test_a_misbehaving_engine_is_retried_elsewhere_and_evicted(fault, engine_url, free_port):
    bad, runner = await _misbehaving_engine(fault, free_port())
    good = engine_url
    pool = EnginePool(RolloutConfig(request_timeout_s=1.0, rollout_health_check_failures=2, affinity_slack=1000))
    await pool.register(bad)
    await pool.register(good)
    affinity = next(f"g{i}" for i in range(100) if pool.pick(f"g{i}").url == bad)  # a group that prefers `bad`
    for _ in range(2):
        answer, engine = await pool.generate(BODY, affinity=affinity)
        assert engine.url == good and len(answer["output_ids"]) == 4
    assert pool.engines[bad].state == EVICTED and pool.engines[good].state == HEALTHY
    assert pool.engines[bad].last_error.startswith("/generate failed")
    await pool.close()
    await runner.cleanup()


def test_a_reward_service_that_is_down_sends_groups_back(make_system, free_port):
    system = make_system(num_engines=1, reward_addr=f"127.0.0.1:{free_port()}")
    assert_groups_come_back(system)


async def test_an_eviction_ends_its_engines_requests_and_a_callers_cancel_stays_a_cancel(engine_url, free_port):
    """A request hanging on an engine that is evicted goes to another engine at once (not after the request timeout);
    a caller that cancels its own request sees the cancellation."""
    bad, runner = await _misbehaving_engine("hang", free_port())
    pool = EnginePool(RolloutConfig(request_timeout_s=60.0, affinity_slack=1000))
    await pool.register(bad)
    await pool.register(engine_url)
    affinity = next(f"g{i}" for i in range(100) if pool.pick(f"g{i}").url == bad)
    request = asyncio.create_task(pool.generate(BODY, affinity=affinity))
    while not pool.engines[bad].outstanding:
        await asyncio.sleep(0.01)
    pool.evict(pool.engines[bad], "hung")
    answer, engine = await asyncio.wait_for(request, 30)  # well before the 60 s request timeout
    assert engine.url == engine_url and len(answer["output_ids"]) == 4
    await pool.deregister(engine_url)
    pool.engines[bad].state = HEALTHY  # back, and hanging again: this time the caller gives up
    request = asyncio.create_task(pool.generate(BODY, affinity=affinity))
    while not pool.engines[bad].outstanding:
        await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert pool.engines[bad].outstanding == 0 and not pool.engines[bad].requests
    await pool.close()
    await runner.cleanup()
