"""Weight updates as SGLang receives them: the trainer is rank 0 of a custom process group; each named tensor (or
one flattened uint8 bucket) arrives by broadcast in `names` order and is loaded by HF parameter name between decode
steps. Updates must run inside a begin/end session, as in SGLang 0.5.21 and newer.

A receive never outlives its weight group's usefulness: it ends when the broadcast arrived, when the group is destroyed
(the gateway gave up on this sync) or at the receive deadline; NCCL groups are then aborted, which ends their kernels.
"""

import asyncio
import base64
import threading
import time
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers the tensor reductions ForkingPickler reads
from starlette.requests import Request
from starlette.responses import Response

from services.engine.checkpoint_names import checkpoint_tensors, parameter_view
from services.engine.responses import control, error, json_response
from services.weightsync.group import (
    abort_group,
    end_group,
    group_settings,
    init_custom_process_group,
    unflatten,
    wait_for,
)

POLL_S = 0.0001  # how often a receive looks at its broadcasts, the cancel flag and the deadline


class WeightReceiver:
    def __init__(self, engine, timeout_s: float = 300.0):
        self.engine, self.timeout_s = engine, timeout_s
        # name → (process group, its cancel flag: set by destroy, a pending receive of that group gives up)
        self.groups: dict[str, tuple[object, threading.Event]] = {}
        self.session_open = False
        # The model's tensors by checkpoint name, looked up once and again only after a memory release or resume
        # (which move them: api.py): building the map is a model walk (state_dict), several ms for a 4B model.
        self.tensors: dict[str, torch.Tensor] | None = None
        self.flats: tuple = (None, {})  # the tensors' 1-D views by name, and the map they were made from
        self.receiving = asyncio.Lock()  # a group is destroyed only between receives
        # Ordered buckets (a slipstream extension, `sequence` in the body): each is posted in its turn, in the
        # sender's order on every engine alike, while those before it are still arriving or loading.
        self.turn, self.turns = 0, asyncio.Condition()
        self.waiting: dict[asyncio.Future, threading.Event] = {}  # ordered receives posted, by their group's flag

    async def init_group(self, request: Request) -> Response:
        body = await request.json()
        try:  # rank_offset: one member per TP rank; this engine has one
            backend, init, world_size, rank, name = group_settings(body)
        except (KeyError, ValueError, TypeError) as e:
            return control(False, f"Failed to initialize custom process group: bad field {e}.")
        try:  # blocks until every rank joined: run it off the event loop
            group = await asyncio.to_thread(init_custom_process_group, backend, init, world_size, rank, name)
            self.groups[name] = (group, threading.Event())
        except Exception as e:  # reported in SGLang's shape
            return control(False, f"Failed to initialize custom process group: {e}.")
        return control(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: Request) -> Response:
        name = (await request.json()).get("group_name", "weight_update_group")
        if name not in self.groups:
            return control(False, "The group to be destroyed does not exist.")
        cancelled = self.groups[name][1]
        cancelled.set()  # a receive in progress gives up: its broadcast may never come
        async with self.turns:
            self.turns.notify_all()  # and so does one waiting for its turn
        async with self.receiving:
            await asyncio.gather(*(w for w, flag in self.waiting.items() if flag is cancelled), return_exceptions=True)
            joined = self.groups.pop(name, None)  # a receive that gave up has already let it go
            if joined is not None:  # no receive in flight: they hold `receiving`
                end_group(joined[0], in_flight=False)
        return control(True, "Succeeded to destroy custom process group.")

    async def begin(self, request: Request) -> Response:
        self.turn = 0  # ordered buckets count from here, even in a session a gateway that died left open
        if self.session_open:
            return control(False, "A weight update session is already open; call end_weight_update() first.")
        self.session_open = True
        return control(True, "Weight update session started.")

    async def end(self, request: Request) -> Response:
        if not self.session_open:
            return control(False, "No weight update session is open; call begin_weight_update() first.")
        self.session_open = False
        return control(True, "Weight update session ended.")

    async def update_from_distributed(self, request: Request) -> Response:
        body = await request.json()
        names, dtypes, shapes = body.get("names", []), body.get("dtypes", []), body.get("shapes", [])
        name = body.get("group_name", "weight_update_group")
        joined = self.groups.get(name)
        if joined is None:
            return control(False, "Failed to update weights: the weight update group does not exist.")
        if not self.session_open:
            return control(
                False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()."
            )
        if not len(names) == len(dtypes) == len(shapes):
            return control(False, "Failed to update weights: names, dtypes and shapes differ in length.")
        try:
            torch_dtypes = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes]
        except AttributeError as e:
            return control(False, f"Failed to update weights: unknown dtype ({e}).")
        flat = body.get("load_format") == "flattened_bucket"
        device = self.engine.device
        sequence = body.get("sequence")
        deadline = time.monotonic() + self.timeout_s
        # Receive first, whatever happens next: the sender's broadcasts must always be matched.
        try:
            if sequence is None:  # SGLang's way: one bucket at a time
                async with self.receiving:
                    tensors = await asyncio.to_thread(_receive, *joined, torch_dtypes, shapes, flat, device, deadline)
            else:
                tensors = await self._receive_in_turn(int(sequence), joined, torch_dtypes, shapes, flat, deadline)
        except Exception as e:  # the trainer or another member is gone: so is the group
            if self.groups.get(name) is joined:
                abort_group(self.groups.pop(name)[0])
            return control(False, f"Failed to update weights: the weight update group broke: {e}.")
        return await self._load(names, tensors, body)

    async def _receive_in_turn(self, sequence: int, joined: tuple, dtypes, shapes, flat: bool, deadline: float):
        """An ordered bucket: its receives are posted once those of every bucket before it are (they complete in that
        order), and it is loaded as soon as it arrived, while the next ones arrive."""
        group, cancelled = joined
        async with self.turns:
            in_turn = self.turns.wait_for(lambda: self.turn == sequence or cancelled.is_set())
            try:
                await asyncio.wait_for(in_turn, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError(f"bucket {sequence} never came in turn (the engine is at {self.turn})") from None
            if cancelled.is_set():
                raise RuntimeError("the weight update group was destroyed while receiving")
            try:
                async with self.receiving:
                    tensors, handles = await asyncio.to_thread(_post, group, dtypes, shapes, flat, self.engine.device)
            finally:
                self.turn += 1
                self.turns.notify_all()
        waited = asyncio.ensure_future(asyncio.to_thread(wait_for, handles, cancelled, deadline, POLL_S))
        self.waiting[waited] = cancelled
        try:
            await waited
        finally:
            self.waiting.pop(waited)
        return unflatten(tensors[0], dtypes, shapes) if flat else tensors

    async def update_from_tensor(self, request: Request) -> Response:
        """Colocated updates: the tensors themselves, pickled by torch.multiprocessing (CUDA ones as IPC handles into
        the sender's memory), one payload per TP rank; this engine has one rank."""
        body = await request.json()
        if not self.session_open:
            return control(
                False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()."
            )
        payloads = body.get("serialized_named_tensors") or []
        if body.get("load_format") or not payloads:
            return control(
                False,
                "Failed to update weights: send serialized_named_tensors, one per TP rank "
                "(flattened buckets are not supported here).",
            )
        try:
            named = ForkingPickler.loads(base64.b64decode(payloads[0]))
            names, tensors = [n for n, _ in named], [t for _, t in named]
        except Exception as e:
            return control(False, f"Failed to update weights: cannot read serialized_named_tensors ({e}).")
        return await self._load(names, tensors, body)

    async def _load(self, names: list[str], tensors: list[torch.Tensor], body: dict) -> Response:
        problem = self.check(names, [tensor.shape for tensor in tensors])
        if problem:
            return control(False, f"Failed to update weights: {problem}.")
        loading = self.copy_in(names, tensors, body.get("weight_version"), bool(body.get("abort_all_requests")))
        await asyncio.wrap_future(loading)
        return control(True, "Succeeded to update model weights.")

    def copy_in(
        self, names: list[str], tensors: list[torch.Tensor], version=None, abort: bool = False, flat: bool = False
    ) -> Future:
        """Copies checked tensors into the model's parameters on the engine thread, between decode steps; done (the
        copies too, on a GPU) when the future is. `flat`: each tensor is 1-D, its parameter's elements in order."""

        def load() -> None:
            if abort:
                self.engine.abort(self.engine.running(), "Abort by weight update")
            parameters = self._tensors()
            if names:  # one call for the bucket: a copy_ a tensor costs the dispatcher's overhead each
                with torch.no_grad():
                    targets = [self._flat(name) if flat else parameter_view(parameters, name) for name in names]
                    torch._foreach_copy_(targets, list(tensors))
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
            if version is not None:
                self.engine.weight_version = str(version)

        return self.engine.call(load)

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self.tensors is None:
            self.tensors = checkpoint_tensors(self.engine.model)
        return self.tensors

    def _flat(self, name: str) -> torch.Tensor:
        """The parameter (or view into one) of a checked name, 1-D; made once while the model's tensors stay put."""
        if self.flats[0] is not self._tensors():
            self.flats = (self.tensors, {})
        flats = self.flats[1]
        if name not in flats:
            flats[name] = parameter_view(self.tensors, name).view(-1)
        return flats[name]

    def check(self, names: list[str], shapes: list) -> str | None:
        """Why tensors of these names and shapes cannot be loaded (a name the model lacks, a shape it does not have),
        or None."""
        parameters = self._tensors()
        for name, shape in zip(names, shapes, strict=True):
            target = parameter_view(parameters, name)
            if target is None:
                return f"the model has no parameter named {name!r}"
            if tuple(target.shape) != tuple(shape):
                return f"{name} has shape {tuple(target.shape)}, got {tuple(shape)}"
        return None

    async def update_weight_version(self, request: Request) -> Response:
        body = await request.json()
        version = str(body.get("new_version", ""))
        if not version:
            return error("new_version is required")

        def apply() -> None:
            if body.get("abort_all_requests"):
                self.engine.abort(self.engine.running(), "Abort by weight version update")
            self.engine.weight_version = version

        await asyncio.wrap_future(self.engine.call(apply))
        return control(True, f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self, request: Request) -> Response:
        body = await request.json() if await request.body() else dict(request.query_params)
        parameter = parameter_view(checkpoint_tensors(self.engine.model), body.get("name", ""))
        if parameter is None:
            return error("Get parameter by name failed")
        truncate = int(body.get("truncate_size", 100))
        return json_response(parameter.detach().float().cpu()[:truncate].tolist())

    def routes(self) -> list[tuple]:
        return [
            ("/init_weights_update_group", self.init_group, ["POST"]),
            ("/destroy_weights_update_group", self.destroy_group, ["POST"]),
            ("/begin_weight_update", self.begin, ["POST"]),
            ("/end_weight_update", self.end, ["POST"]),
            ("/update_weights_from_distributed", self.update_from_distributed, ["POST"]),
            ("/update_weights_from_tensor", self.update_from_tensor, ["POST"]),
            ("/update_weight_version", self.update_weight_version, ["POST"]),
            ("/get_weights_by_name", self.get_weights_by_name, ["GET", "POST"]),
        ]


def _receive(group, cancelled: threading.Event, dtypes, shapes, flat: bool, device, deadline: float) -> list:
    tensors, handles = _post(group, dtypes, shapes, flat, device)
    wait_for(handles, cancelled, deadline, POLL_S)
    return unflatten(tensors[0], dtypes, shapes) if flat else tensors


def _post(group, dtypes, shapes, flat: bool, device) -> tuple[list, list]:
    """The bucket's receives, posted: its tensors (a flattened bucket: one uint8 buffer) and their broadcasts."""
    if flat:
        sizes = [
            torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for d, s in zip(dtypes, shapes, strict=True)
        ]
        tensors = [torch.empty(sum(sizes), dtype=torch.uint8, device=device)]
    else:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in zip(dtypes, shapes, strict=True)]
    return tensors, [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
