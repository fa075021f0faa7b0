"""The gateway's side of LoRA (services/rollout/adapters.py) against a recording pool: requests ask for the live
adapter by the run's name, an engine that lacks it (admitted after the sync) loads it first, answers carry the
adapter's version, and an older adapter is unloaded only once no request of this gateway uses it."""

import asyncio
from types import SimpleNamespace

from services.rollout.adapters import Adapters, server_options


class Pool:
    router = None

    def __init__(self):
        self.engines = {"http://e": SimpleNamespace(url="http://e")}
        self.calls: list[tuple[str, dict]] = []

    async def _post(self, engine, path: str, body: dict):
        self.calls.append((path, body))
        return {"success": True}


async def test_requests_use_the_live_adapter_and_an_old_one_goes_once_unused():
    pool = Pool()
    adapters, engine = Adapters(pool, "run"), pool.engines["http://e"]
    assert await adapters.request(engine, {"x": 1}) == ({"x": 1}, None)  # no sync yet: the base model
    adapters.committed(1, "/w/weight_v000001", ["http://e"])
    first, version = await adapters.request(engine, {"x": 1})
    assert first == {"x": 1, "lora_path": "run-v1"} and version == 1 and pool.calls == []  # loaded at the commit
    answer = adapters.label([{"meta_info": {"weight_version": "0", "weight_versions": []}}], version)
    assert answer == [{"meta_info": {"weight_version": "1"}}]

    adapters.committed(2, "/w/weight_v000002", ["http://e"])
    await asyncio.sleep(0.05)
    assert pool.calls == []  # run-v1 still has a request in flight
    adapters.done(first)
    await asyncio.sleep(0.05)
    assert pool.calls == [("/unload_lora_adapter", {"lora_name": "run-v1"})]

    adapters.forget("http://e")  # evicted: it may come back restarted, holding nothing
    second, _ = await adapters.request(engine, {})
    assert second["lora_path"] == "run-v2"
    assert pool.calls[-1] == ("/load_lora_adapter", {"lora_name": "run-v2", "lora_path": "/w/weight_v000002"})
    await adapters.close()


def test_the_engines_options_name_the_trainers_targets():
    config = SimpleNamespace(lora_rank=16, target_modules=["all-linear", "lm_head"])
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    assert server_options(config) == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", *modules]
    assert server_options(SimpleNamespace(lora_rank=0, target_modules=["all-linear"])) == []
