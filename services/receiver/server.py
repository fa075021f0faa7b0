"""The weight receiver's HTTP API, which the gateway calls: it joins and leaves the trainer's weight group as SGLang's
engines do (/init_weights_update_group, /destroy_weights_update_group, the same bodies; one rank per engine), and
/receive_weights takes a sync's whole plan (every bucket's names, dtypes and shapes) and answers once the engine has
loaded every bucket (services/receiver/stream.py)."""

import asyncio
import logging
import threading
import time

import torch
import torch.multiprocessing
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.engine.responses import control
from services.receiver.config import ReceiverConfig
from services.receiver.stream import Bucket, Buffers, Copies, EngineRoute, Sync
from services.weightsync.group import abort_group, end_group, group_settings, init_custom_process_group

log = logging.getLogger(__name__)


class Receiver:
    def __init__(self, config: ReceiverConfig):
        self.config = config
        step, first = config.gpu_id_step, config.base_gpu_id
        devices = (
            [torch.device("cuda", first + i * step) for i in range(config.tp_size)]
            if config.device == "cuda"
            else [torch.device("cpu")]
        )
        self.buffers = Buffers(devices, config.buffer_mib << 20)
        self.copies: dict[str, Copies] = {}  # --update-weight-mode delta: each group's buckets, the deltas' base
        self.groups: dict[str, tuple[object, threading.Event]] = {}  # name → (group, its cancel flag)
        self.syncing = asyncio.Lock()  # one sync at a time; a group is destroyed only between syncs
        self.plan: tuple[list, list[Bucket]] = ([], [])  # the last sync's plan, as sent and read: syncs repeat it
        headers = {"Authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}
        self.engine = EngineRoute(config.engine_url, "/update_weights_from_ipc", headers)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def init_group(self, request: Request) -> Response:
        try:
            backend, init, world_size, rank, name = group_settings(await request.json())
        except (KeyError, ValueError, TypeError) as e:
            return control(False, f"Failed to initialize custom process group: bad field {e}.")
        if backend == "nccl":
            torch.cuda.set_device(self.buffers.devices[0])
        try:  # blocks until every rank joined
            group = await asyncio.to_thread(init_custom_process_group, backend, init, world_size, rank, name)
        except Exception as e:
            return control(False, f"Failed to initialize custom process group: {e}.")
        self.groups[name] = (group, threading.Event())
        return control(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: Request) -> Response:
        name = (await request.json()).get("group_name", "weight_update_group")
        if name not in self.groups:
            return control(False, "The group to be destroyed does not exist.")
        self.groups[name][1].set()  # a sync in progress gives up: its broadcasts may never come
        async with self.syncing:
            joined = self.groups.pop(name, None)  # a sync that failed has let it go already
            if joined is not None:
                end_group(joined[0], in_flight=False)
        return control(True, "Succeeded to destroy custom process group.")

    async def receive_weights(self, request: Request) -> Response:
        body = await request.json()
        name = body.get("group_name", "weight_update_group")
        try:
            buckets = self.plan[1] if body["buckets"] == self.plan[0] else [_bucket(b) for b in body["buckets"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return control(
                False,
                f"Failed to receive weights: buckets must be a list of {{names, dtypes, shapes}} "
                f"of equal lengths ({type(e).__name__}: {e}).",
            )
        async with self.syncing:
            joined = self.groups.get(name)
            if joined is None:
                return control(False, f"Failed to receive weights: no weight group {name!r}; join it first.")
            version, delta = body.get("weight_version"), body.get("delta")
            buffers = self.buffers if delta is None else self.copies.setdefault(name, Copies(self.buffers.devices))
            sync = Sync(
                *joined,
                buckets,
                buffers,
                self.engine,
                None if version is None else str(version),
                bool(body.get("flush_cache", False)),
                self.config.timeout_s,
                delta,
            )
            started = time.perf_counter()
            try:
                await asyncio.to_thread(sync.run)
            except Exception as e:  # the trainer, the engine or another member is gone: the group goes too
                if self.groups.get(name) is joined:
                    abort_group(self.groups.pop(name)[0])
                if delta is not None:  # part of them may be the new version's
                    buffers.version = None
                log.warning("sync of %d buckets failed: %s", len(buckets), e)
                return control(False, f"Failed to receive weights: {e}.")
            if delta is not None:
                buffers.version = delta["version"]
            self.plan = body["buckets"], buckets
            took, waited = time.perf_counter() - started, sync.waited
        log.info(
            "sync of %d buckets (%.2f GB) loaded in %.1f ms: %.1f ms waiting for broadcasts, %.1f ms for the engine",
            len(buckets),
            sum(b.layout[1] for b in buckets) / 1e9,
            took * 1e3,
            waited["broadcasts"] * 1e3,
            waited["engine"] * 1e3,
        )
        return control(True, f"Succeeded to receive {len(buckets)} buckets.")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/init_weights_update_group", self.init_group, methods=["POST"]),
                Route("/destroy_weights_update_group", self.destroy_group, methods=["POST"]),
                Route("/receive_weights", self.receive_weights, methods=["POST"]),
            ]
        )


def _bucket(body: dict) -> Bucket:
    names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), [list(s) for s in body["shapes"]]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes differ in length")
    resolved = [getattr(torch, d) for d in dtypes]
    if not all(isinstance(d, torch.dtype) for d in resolved):
        raise ValueError(f"unknown dtype among {dtypes}")
    return Bucket(names, resolved, [[int(n) for n in s] for s in shapes])


def serve(config: ReceiverConfig) -> int:
    import uvicorn

    from services.engine.server import require_api_key
    from services.weightsync.group import apply_nccl_settings

    apply_nccl_settings()  # both ends of the weight group must agree (the trainer sets the same)
    torch.multiprocessing.set_sharing_strategy("file_system")  # a CPU buffer goes to the engine by file name
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    app = Receiver(config).app()
    if config.api_key:
        app = require_api_key(app, config.api_key)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
