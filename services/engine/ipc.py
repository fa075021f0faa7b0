"""SGLang's `/update_weights_from_ipc` (0.5.23), the route the weight receiver beside an engine feeds
(services/receiver): checkpoint-engine's worker protocol over ZMQ. The engine connects a REP socket to the address
given for its device in `zmq_handles` and is sent, each message answered before the next:

1. its buffer: a CUDA IPC handle of a uint8 tensor (`reduce_tensor`'s rebuild function and arguments), or on the CPU
   that tensor pickled by torch.multiprocessing (its shared-memory file): answered b"";
2. per bucket, its tensors' metadata (name, dtype, shape, byte offset into the buffer): loaded, answered b"" or with
   the error's text; meanwhile the sender fills the buffer's other half with the next bucket;
3. None, twice (checkpoint-engine 0.4.2: the buffer is let go, then the post-load hook runs); an Exception instead
   ends the update with it.

The HTTP call answers once the sender is done. Addresses are local ZMQ sockets only (`ipc://`): the route never
connects anywhere else.

The sender's buffer stays mapped after an update (the protocol lets it go): the next update that hands over the same
buffer maps it at no cost (torch keeps one mapping of a storage a process holds), and a bucket whose message is the
same bytes as one loaded from that buffer before (a weight receiver's, from one sync to the next) is loaded without
reading its metadata, checking it or making its views again."""

import asyncio
import functools
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import zmq
from starlette.requests import Request
from starlette.responses import Response

from services.engine.responses import control
from services.weightsync.group import flat_views

MAX_KNOWN = 4096  # buckets' messages kept with their views


def device_key(device: torch.device) -> str:
    """A device's key in `zmq_handles`: SGLang's "GPU-<uuid>" (the same in every process on that GPU); "cpu" for the
    reference engine on the CPU."""
    if device.type == "cuda":
        return _gpu_key(torch.cuda.current_device() if device.index is None else device.index)
    return "cpu"


@functools.cache  # read once a GPU: a sync asks at every call
def _gpu_key(index: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class IpcUpdates:
    def __init__(self, weights, timeout_s: float):
        self.weights, self.engine, self.timeout_s = weights, weights.engine, timeout_s
        self.updating = asyncio.Lock()  # one update at a time, as SGLang's model-update lock
        self.mapped: torch.Tensor | None = None  # the last sender's buffer
        self.known: dict[bytes, tuple[list[str], list[torch.Tensor]]] = {}  # loaded from it: names and views by message

    async def update_from_ipc(self, request: Request) -> Response:
        body = await request.json()
        handles, version = body.get("zmq_handles"), body.get("weight_version")
        key = device_key(self.engine.device)
        if not isinstance(handles, dict) or not isinstance(handles.get(key), str):
            given = sorted(handles) if isinstance(handles, dict) else handles
            return control(
                False,
                f"Failed to update weights: zmq_handles has no address for this engine's device "
                f"{key!r} (it has {given!r}).",
            )
        if not handles[key].startswith("ipc://"):
            return control(False, f"Failed to update weights: zmq_handles[{key!r}] must be a local ipc:// address.")
        async with self.updating:
            try:
                loaded = await asyncio.to_thread(self._serve, handles[key])
            except Exception as e:  # the sender's, a load's, or the socket's
                return control(False, f"Failed to update weights: {e}.")
        if version is not None:
            await asyncio.wrap_future(self.weights.copy_in([], [], version))
        return control(True, f"Succeeded to update model weights ({loaded} buckets).")

    def _serve(self, address: str) -> int:
        """Answers the sender until it is done; returns the number of buckets loaded."""
        socket = zmq.Context.instance().socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
        socket.connect(address)
        buffer, loaded, ends = None, 0, 0
        try:
            while ends < 2:
                try:
                    message = socket.recv()
                except zmq.Again:
                    raise RuntimeError(f"the sender said nothing for {self.timeout_s:.0f} s") from None
                if buffer is not None and message in self.known:
                    self.weights.copy_in(*self.known[message], flat=True).result()
                    loaded += 1
                    socket.send(b"")
                    continue
                payload = pickle.loads(message)
                if isinstance(payload, Exception):
                    raise RuntimeError(f"the sender ended the update: {payload}")
                if payload is None:
                    buffer, ends = None, ends + 1
                    socket.send(b"")
                elif buffer is None:
                    buffer = self._map(payload)
                    socket.send(b"")
                else:
                    problem = self._load(buffer, payload, message)
                    loaded += problem is None
                    socket.send((problem or "").encode())
            return loaded
        finally:
            socket.close()

    def _map(self, handle) -> torch.Tensor:
        """The sender's buffer, in this process: a CUDA IPC handle opened on this engine's GPU, or a CPU tensor's
        shared memory."""
        if isinstance(handle, bytes):
            buffer = ForkingPickler.loads(handle)
        else:
            rebuild, args = handle
            args = list(args)
            args[6] = self.engine.device.index  # the device the sender's handle names, as this process numbers it
            buffer = rebuild(*args)
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
            raise RuntimeError(f"the sender's buffer is not a uint8 tensor ({type(buffer).__name__})")
        mapped = self.mapped
        if mapped is None or (mapped.data_ptr(), mapped.numel()) != (buffer.data_ptr(), buffer.numel()):
            self.known = {}  # another buffer (both mapped until now: they cannot share an address)
        self.mapped = buffer
        return buffer

    def _load(self, buffer: torch.Tensor, metadata: list[dict], message: bytes) -> str | None:
        """Loads one bucket (its `metadata`, sent as `message`); why it could not be, or None."""
        try:
            names, shapes = [m["name"] for m in metadata], [torch.Size(m["shape"]) for m in metadata]
            numels, offsets = [shape.numel() for shape in shapes], [int(m["offset"]) for m in metadata]
            tensors = flat_views(buffer, [m["dtype"] for m in metadata], numels, offsets)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            return f"bad bucket metadata: {e}"
        problem = self.weights.check(names, shapes)
        if problem is None:
            self.weights.copy_in(names, tensors, flat=True).result()
            if len(self.known) > MAX_KNOWN:
                self.known = {}
            self.known[message] = names, tensors
        return problem

    def routes(self) -> list[tuple]:
        return [("/update_weights_from_ipc", self.update_from_ipc, ["POST"])]
