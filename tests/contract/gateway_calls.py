"""Every HTTP request the gateway sends to an engine, as it sends them: our gateway's own code (engine pool, generation,
rollout sampling settings, weight sync, launcher) is driven through everything that calls an engine, against a
stand-in SGLang server that answers in SGLang's shapes and records each request. The stand-in reports the SGLang
version it is told in /server_info, so the calls are the ones the gateway makes to an engine of that release.

`routes_in_code` lists the routes the gateway's modules name, read from their source: a route that no recorded flow
reaches means a call this file does not drive yet."""

import ast
import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestServer

from services.common import launch
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from services.rollout.generate import GenerateContext, generate_group
from services.rollout.teacher import Teacher
from services.rollout.weight_sync import WeightSync
from services.rollout.workers import Rollout
from services.weightsync.protocol import Bucket
from slipstream import samples
from slipstream.v1 import common_pb2, rollout_pb2
from tests.python_source import parse

REPO = Path(__file__).resolve().parents[2]
GATEWAY = [
    *sorted((REPO / "services" / "rollout").glob("*.py")),
    *sorted((REPO / "services" / "common").glob("*.py")),
    *sorted((REPO / "services" / "weightsync").glob("*.py")),
]
ROUTE = re.compile(r"^/[a-z_]+(/[a-z_]*)*$")


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: dict | list | None


def record(version: str) -> list[Call]:
    """The requests the gateway sends to one engine of SGLang `version`, in order."""
    return asyncio.run(_record(version))


async def _record(version: str) -> list[Call]:
    calls: list[Call] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        calls.append(Call(request.method, request.path, body))
        if request.path in ("/health", "/health_generate"):
            return web.Response()
        return web.json_response(_answer(request.path, body, version))

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        await _drive(str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()
    return calls


async def _drive(url: str) -> None:
    config = RolloutConfig(
        use_rollout_routing_replay=True, partial_rollout=True, rollout_stop=["\n\n"], rollout_stop_token_ids=[7],
        eval_temperature=0.5, eval_top_p=0.9, eval_top_k=20, eval_max_response_len=16,
        update_weight_disk_dir="/shared/weights", use_opd=True, opd_type="sglang", opd_teacher_urls=["http://t:1"],
    )  # fmt: skip
    pool = EnginePool(config)
    try:
        await launch.wait_ready(launch.Child("engine-0", url, SimpleNamespace(poll=lambda: None), Path("-")), "/health")
        engine = await pool.register(url)
        await pool.check(engine)
        await pool.alive(engine)
        rollout = Rollout(config, pool, buffer=None, reward=None)
        for sampling in (rollout.sampling(), rollout.sampling(_every_override(), evaluation=True)):
            await generate_group(GenerateContext(pool, sampling, config), _group_with_partial_sample(), resume=True)
        teacher = Teacher(config)  # on-policy distillation: the teacher's log-probs of a finished group
        await teacher.register([url])
        finished = _group_with_partial_sample()
        finished.samples[0].status = common_pb2.SAMPLE_STATUS_COMPLETED
        await teacher.annotate(finished)
        await teacher.close()
        sync = WeightSync(config, pool, _Buffer())
        sources = [("weights-0", "127.0.0.1", 29500)]
        await sync.release()  # colocated: memory released before the sync, taken back by it
        await sync.prepare(1, sources, "nccl")
        await sync.bucket(Bucket(0, ["w"], ["bfloat16"], [[2, 2]], "flattened_bucket", (), "weights-0"))
        await sync.commit(1)
        await sync.prepare(2, sources, "", rollout_pb2.WEIGHT_TRANSPORT_HANDLES)
        await sync.bucket(Bucket(0, ["w"], ["bfloat16"], [[2, 2]], "", (b"handles",)))
        await sync.abort(2, "the trainer went away")
        await sync.prepare(
            3, sources, "", rollout_pb2.WEIGHT_TRANSPORT_DISK
        )  # --update-weight-transport disk: loaded at the commit
        await sync.bucket(Bucket(0, ["w"], ["bfloat16"], [[2, 2]], "", (), "weights-0"))
        await sync.commit(3)
    finally:
        await pool.close()
    await _drive_lora(url)


async def _drive_lora(url: str) -> None:
    """--lora-rank: each sync an adapter loaded at its commit, generation asking for the live one, the older one
    unloaded."""
    config = RolloutConfig(lora_rank=8, update_weight_disk_dir="/shared/weights")
    pool = EnginePool(config)
    try:
        await pool.register(url)
        sync = WeightSync(config, pool, _Buffer())
        for version in (1, 2):
            await sync.prepare(version, [("weights-0", "127.0.0.1", 29500)], "", rollout_pb2.WEIGHT_TRANSPORT_LORA)
            await sync.bucket(Bucket(0, ["w.lora_A.weight"], ["bfloat16"], [[2, 2]], "", (), "weights-0"))
            await sync.commit(version)
            group = _group_with_partial_sample()
            await generate_group(GenerateContext(pool, {"max_new_tokens": 2}, config), group, resume=True)
        await asyncio.gather(*pool.adapters._unloads)
    finally:
        await pool.close()


def routes_in_code() -> dict[str, set[str]]:
    """Route → the gateway modules that name it: string literals such as "/generate" and the path after an
    f-string's address (f"{url}/health_generate"), except in sets (IDEMPOTENT names routes, it calls none)."""
    found: dict[str, set[str]] = {}
    for path in GATEWAY:
        tree = parse(path.read_text())
        for text in _strings(tree):
            if ROUTE.match(text.removesuffix("{}")):
                found.setdefault(text, set()).add(str(path.relative_to(REPO)))
    return found


def _strings(tree: ast.Module) -> list[str]:
    """The module's string literals outside sets and f-strings, and each f-string part that follows a substitution
    ("{}" marking a substitution after it)."""
    skipped = set()
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Set):
            skipped |= {id(e) for e in node.elts}
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            skipped |= {id(p) for p in parts}
            for i, part in enumerate(parts[1:], 1):
                if isinstance(part, ast.Constant) and isinstance(parts[i - 1], ast.FormattedValue):
                    texts.append(part.value + ("{}" if i + 1 < len(parts) else ""))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            texts.append(node.value)
    return texts


class _Buffer:
    async def SetPolicyVersion(self, request, timeout=None, wait_for_ready=None):
        return None


def _every_override() -> common_pb2.SamplingParams:
    """A SamplingParams message with every field set: each becomes a sampling_params key."""
    values = {"float": 0.5, "int32": 4, "int64": 4, "bool": True, "string": "x"}
    message = common_pb2.SamplingParams()
    for field in message.DESCRIPTOR.fields:
        value = values[_type(field)]
        if field.is_repeated:
            getattr(message, field.name).append(value)
        else:
            setattr(message, field.name, value)
    return message


def _type(field) -> str:
    return {field.TYPE_FLOAT: "float", field.TYPE_DOUBLE: "float", field.TYPE_INT32: "int32",
            field.TYPE_INT64: "int64", field.TYPE_BOOL: "bool", field.TYPE_STRING: "string"}[field.type]  # fmt: skip


def _group_with_partial_sample() -> common_pb2.PromptGroup:
    """A group of 3 with one sample aborted after one token: it is resumed, the other two are generated (n=2)."""
    group = common_pb2.PromptGroup(group_id="g", n_samples=3, prompt_tokens=samples.encode_tokens([1, 2, 3]))
    group.samples.add(status=common_pb2.SAMPLE_STATUS_ABORTED, tokens=samples.encode_tokens([1, 2, 3, 4]),
                      prompt_length=3, response_length=1, loss_mask=samples.encode_mask([1]),
                      rollout_logprobs=samples.encode_logprobs([-0.5]))  # fmt: skip
    return group


def _answer(path: str, body, version: str):
    """SGLang's answer to each call, as much of it as the gateway reads."""
    if path == "/server_info":
        return {"tp_size": 1, "base_gpu_id": 0, "gpu_id_step": 1, "version": version}
    if path == "/model_info":
        return {"model_path": "stand-in", "weight_version": "0"}
    if path == "/generate":
        n = (body.get("sampling_params") or {}).get("n", 1)
        meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                "input_token_logprobs": [[None, 1, None], [-0.1, 2, None], [-0.2, 3, None],
                                         [-0.3, 4, None]]}  # fmt: skip
        output = {"text": "ab", "output_ids": [5, 6], "meta_info": meta}
        return [output] * n if n > 1 else output
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        return None
    return {"success": True, "message": "done"}
