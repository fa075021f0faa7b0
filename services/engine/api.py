"""The HTTP API, route by route as SGLang 0.5.23 serves it (docs/sglang_api.md): /generate (single, batch,
n > 1, streaming), aborts, health, model and server info, pause/continue, memory release, and weight updates."""

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from services.engine.batch import Sequence
from services.engine.core import Engine
from services.engine.disk import DiskUpdates
from services.engine.ipc import IpcUpdates
from services.engine.lora import LoraError, LoraRoutes
from services.engine.memory import HostCopy
from services.engine.responses import SSE_DONE, error, generate_output, json_response, sse
from services.engine.routing import check_start_len
from services.engine.sampling import BadRequest, parse_sampling
from services.engine.weights import WeightReceiver

HEALTH_TIMEOUT_S = 20.0


class EngineAPI:
    def __init__(
        self, engine: Engine, info: dict, weight_update_timeout_s: float = 300.0, weight_disk_dir: str | None = None
    ):
        self.engine, self.info = engine, info
        self.weights = WeightReceiver(engine, weight_update_timeout_s)
        self.ipc = IpcUpdates(self.weights, weight_update_timeout_s)
        self.disk = DiskUpdates(self.weights, weight_disk_dir)
        self.lora = LoraRoutes(engine, weight_disk_dir)
        self.host_copy = HostCopy(engine.model, engine.device)
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.started = time.time()

    # /generate

    async def generate(self, request: Request) -> Response:
        try:
            body = await request.json()
            requests, single = self._expand(body)
        except BadRequest as e:
            return json_response(e.body, 400)
        except ValueError as e:
            return error(str(e))
        await self.unpaused.wait()  # while paused, new requests wait (SGLang blocks them too)
        try:
            self._acquire(requests)
        except LoraError as e:
            return error(str(e))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        start = time.monotonic()
        stream = bool(body.get("stream"))
        for index, seq in enumerate(requests):
            self.engine.submit(seq, _listener(loop, queue, index), every_token=stream)
        return_logprob = bool(body.get("return_logprob"))
        version = self.engine.weight_version
        if stream:
            return StreamingResponse(
                self._stream(requests, queue, single, return_logprob, start), media_type="text/event-stream"
            )
        remaining = len(requests)
        while remaining:
            _, finished, _ = await queue.get()
            remaining -= finished
        outputs = [generate_output(s, s.text, version, return_logprob, time.monotonic() - start) for s in requests]
        return json_response(outputs[0] if single else outputs)

    async def _stream(self, requests, queue, single, return_logprob, start):
        remaining = len(requests)
        while remaining:
            index, finished, count = await queue.get()
            seq = requests[index] if finished else _prefix(requests[index], count)
            text = seq.text if finished else self.engine.decode(seq)
            chunk = generate_output(seq, text, self.engine.weight_version, return_logprob, time.monotonic() - start)
            if not single:
                chunk["index"] = index
            remaining -= finished
            yield sse(chunk)
        yield SSE_DONE

    def _expand(self, body: dict) -> tuple[list[Sequence], bool]:
        """The sequences of a request (batch items times n, in SGLang's order i*n + j), and if it was a single one."""
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if input_ids is not None:
            single = not (input_ids and isinstance(input_ids[0], list))
            prompts = [input_ids] if single else input_ids
            if text is not None:  # the batch size comes from text, the tokens from input_ids
                single = isinstance(text, str)
        else:
            single = isinstance(text, str)
            texts = [text] if single else text
            prompts = [self.engine.tokenizer.encode(t) for t in texts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("input_ids cannot be empty.")
        params_list = body.get("sampling_params") or {}
        params_list = params_list if isinstance(params_list, list) else [params_list] * len(prompts)
        params = [parse_sampling(p) for p in params_list]
        if len({p.n for p in params}) > 1:
            raise ValueError("The n parameter should be the same for all samples in a batch.")
        rids = body.get("rid")
        if isinstance(rids, list) and len(rids) != len(prompts):
            raise ValueError("The rid should be a list with the same length as the batch size.")
        sequences = []
        for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            if len(prompt) >= self.engine.max_context:
                raise ValueError(
                    f"The input ({len(prompt)} tokens) is longer than the model's context length "
                    f"({self.engine.max_context} tokens)."
                )
            for j in range(sampling.n):
                rid = self._rid(rids, i, single) if sampling.n == 1 else uuid.uuid4().hex
                sequences.append(self._sequence(rid, prompt, sampling, body, i, j))
        return sequences, single and params[0].n == 1

    def _acquire(self, sequences: list[Sequence]) -> None:
        """The request's adapters count as in use until its sequences finish (an unload waits for them)."""
        names = [seq.lora for seq in sequences]
        if not any(names):
            return
        if self.engine.adapters is None:
            raise LoraError(
                f"LoRA adapter '{next(filter(None, names))}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                "endpoint."
            )
        self.engine.adapters.acquire(names)

    @staticmethod
    def _rid(rids, index: int, single: bool) -> str:
        if rids is None:
            return uuid.uuid4().hex
        if isinstance(rids, list):
            return str(rids[index])
        return str(rids) if single else f"{rids}_{index}"

    def _sequence(self, rid: str, prompt: list[int], sampling, body: dict, index: int, sample: int) -> Sequence:
        pick = lambda key, default: v[index] if isinstance(v := body.get(key, default), list) else v  # noqa: E731
        generator = None
        if sampling.sampling_seed is not None:
            generator = torch.Generator().manual_seed(sampling.sampling_seed + sample)
        seq = Sequence(
            rid,
            list(prompt),
            sampling,
            bool(pick("return_logprob", False)),
            int(pick("logprob_start_len", -1)),
            generator,
        )
        seq.lora = pick("lora_path", None) or None
        if pick("return_routed_experts", False):  # checked even without the server option, as SGLang does
            seq.routed_experts_start_len = check_start_len(pick("routed_experts_start_len", 0) or 0, len(prompt))
            seq.return_routed_experts = self.engine.routing is not None  # else the answer lacks the key, as SGLang's
        return seq

    # Aborts, health, info

    async def abort_request(self, request: Request) -> Response:
        body = await _body(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))

        def abort() -> None:
            running = self.engine.running()
            if abort_all or any(seq.rid == rid for seq in running):
                chosen = running if abort_all else [seq for seq in running if seq.rid.startswith(rid)]
                self.engine.abort(chosen, "Abort by request")

        await asyncio.wrap_future(self.engine.call(abort))
        return Response(status_code=200)

    async def health(self, request: Request) -> Response:
        if not self.unpaused.is_set():
            return Response(status_code=503)
        seq = Sequence(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], parse_sampling({"max_new_tokens": 1, "temperature": 0}))
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.engine.submit(seq, lambda s, finished: loop.call_soon_threadsafe(done.set), every_token=False)
        try:
            await asyncio.wait_for(done.wait(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        config = self.engine.model.config
        return json_response(
            {
                "model_path": self.info["model_path"],
                "tokenizer_path": self.info["model_path"],
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.model_type,
                "architectures": getattr(config, "architectures", None),
                "served_model_name": self.info["model_path"],
            }
        )

    async def server_info(self, request: Request) -> Response:
        states = {
            "batch_sizes": {str(k): v for k, v in sorted(self.engine.batch_sizes.items())},  # decode steps by size
            "num_running_reqs": len(self.engine.batcher.rows),
            "num_waiting_reqs": len(self.engine.waiting),
            "cuda_graph_captures": graphs.captures if (graphs := self.engine.batcher.graphs) else 0,
            "eager_steps": self.engine.batcher.eager_steps,  # steps with prompt chunks (or without graphs)
            "eager_seconds": round(self.engine.batcher.eager_seconds, 6),  # the engine thread's time in them
        }
        return json_response(
            {
                **self.info,
                "tp_size": 1,
                "dp_size": 1,
                "weight_version": self.engine.weight_version,
                "max_total_num_tokens": self.engine.max_context * self.engine.max_batch_size,
                "max_req_input_len": self.engine.max_context - 1,
                "startup_time": self.started,
                "status": "ready",
                "internal_states": [states],
                "version": "0.5.23",
                "engine": "slipstream-reference",
                "ordered_weight_buckets": True,  # update_weights_from_distributed takes `sequence`: docs/engine.md
            }
        )

    async def flush_cache(self, request: Request) -> Response:
        if self.engine.running():
            return PlainTextResponse("Cache not flushed because there are pending requests.", status_code=400)
        await asyncio.wrap_future(self.engine.call(self.engine.batcher.forget_prefixes))  # the prefix cache
        message = (
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n"
        )
        return PlainTextResponse(message)

    # Pause, continue, memory

    async def pause_generation(self, request: Request) -> Response:
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error(f"mode must be abort, retract or in_place, got {mode!r}")

        def pause() -> None:
            if mode == "abort":
                self.engine.abort(self.engine.running(), "Abort by pause_generation")
            elif mode == "retract":
                self.engine.retract()
            self.engine.paused = mode

        self.unpaused.clear()
        await asyncio.wrap_future(self.engine.call(pause))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        def resume() -> None:
            self.engine.paused = None

        await asyncio.wrap_future(self.engine.call(resume))
        self.unpaused.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: Request) -> Response:
        if self.engine.batcher.rows:
            return error("release_memory_occupation needs an idle engine; pause or abort generation first")

        def release() -> None:
            self.engine.batcher.release()
            self.host_copy.release()
            self.weights.tensors = None  # looked up again after the move
            if self.engine.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the device, for the trainer on the same GPU

        await asyncio.wrap_future(self.engine.call(release))
        return json_response(None)

    async def resume_memory(self, request: Request) -> Response:
        def resume() -> None:
            self.host_copy.resume()
            self.weights.tensors = None

        await asyncio.wrap_future(self.engine.call(resume))
        return json_response(None)

    def routes(self) -> list[Route]:
        post, get, both = ["POST", "PUT"], ["GET"], ["GET", "POST"]
        table = [
            ("/generate", self.generate, post),
            ("/abort_request", self.abort_request, ["POST"]),
            ("/health", self.health, get),
            ("/health_generate", self.health, get),
            ("/model_info", self.model_info, get),
            ("/get_model_info", self.model_info, get),
            ("/server_info", self.server_info, get),
            ("/get_server_info", self.server_info, get),
            ("/flush_cache", self.flush_cache, both),
            ("/pause_generation", self.pause_generation, ["POST"]),
            ("/continue_generation", self.continue_generation, ["POST"]),
            ("/release_memory_occupation", self.release_memory, both),
            ("/resume_memory_occupation", self.resume_memory, both),
            *self.weights.routes(),
            *self.ipc.routes(),
            *self.disk.routes(),
            *self.lora.routes(),
        ]
        return [Route(path, handler, methods=methods) for path, handler, methods in table]

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            self.engine.stop()

        return Starlette(routes=self.routes(), lifespan=lifespan)


def _listener(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    """Forwards the engine thread's notifications to the request's queue, with how many tokens the sequence had
    then (it may have advanced by the time a streamed chunk is built); a request that is not streamed is submitted
    to hear only of the end, so the server's thread is not woken for every token."""

    def notify(seq: Sequence, finished: bool) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, finished, len(seq.output_ids)))

    return notify


def _prefix(seq: Sequence, count: int) -> Sequence:
    """The sequence as it was after `count` output tokens (unfinished)."""
    return dataclasses.replace(
        seq,
        output_ids=seq.output_ids[:count],
        output_logprobs=seq.output_logprobs[:count],
        versions=seq.versions[:count],
        finish=None,
    )


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    value = json.loads(raw)
    return value if isinstance(value, dict) else {}
