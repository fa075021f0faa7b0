"""One sync's buckets, from the trainer's weight group to the engine: bucket k is received (one broadcast of its
tensors at `bucket_layout` offsets) into slot k % S of a buffer on the engine's GPU (S slots: as many as --buffer-mib
holds, at least 3) while the engine loads the buckets before it from others, over SGLang's /update_weights_from_ipc
and checkpoint-engine's worker protocol (see services/engine/ipc.py for the engine's side). No control round trip
between buckets: the plan came whole.

Every wait ends: at the broadcast's arrival, when the group is destroyed (the gateway gave up), at the deadline, or
when the engine's call ended (it failed, or an older checkpoint-engine worker stopped at the first None)."""

import http.client
import json
import logging
import os
import pickle
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, count
from multiprocessing.reduction import ForkingPickler
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import torch.multiprocessing
import zmq
from torch.multiprocessing.reductions import reduce_tensor

from services.engine.ipc import device_key
from services.weightsync import delta as weight_delta
from services.weightsync.group import bucket_layout, wait_for

log = logging.getLogger(__name__)

MIN_SLOTS = 3  # the engine loads one bucket while the next arrives and a third waits
MAX_MESSAGES = 4096  # hand-over messages kept pickled (Buffers.message)
POLL_MS = 50  # how often a wait for the engine's answer looks at the cancel flag, the deadline and the engine's call
_sockets = count()
NONE = pickle.dumps(None)


@dataclass(frozen=True)
class Bucket:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]

    @cached_property
    def layout(self) -> tuple[list[int], int]:
        return bucket_layout(self.dtypes, self.shapes)

    @property
    def sizes(self) -> list[int]:
        """Each tensor's bytes."""
        return [torch.Size(s).numel() * dtype.itemsize for dtype, s in zip(self.dtypes, self.shapes, strict=True)]


class Buffers:
    """Room for as many of a sync's buckets as `budget` bytes hold (at least MIN_SLOTS, at most the sync's buckets)
    on each of the engine's devices, kept across syncs and made anew when a sync needs more."""

    def __init__(self, devices: list[torch.device], budget: int = 2 << 30):
        self.devices, self.budget, self.slots, self.slot, self.tensors = devices, budget, 0, 0, []
        self.described, self.messages = None, {}  # the plan, and its buckets' messages to the engine made so far

    def fit(self, buckets: list[Bucket]) -> None:
        slot = max([self.slot, *(bucket.layout[1] for bucket in buckets)])
        slots = max(MIN_SLOTS, min(len(buckets), self.budget // max(slot, 1)))
        if slot > self.slot or slots > self.slots:
            self.slot, self.slots = slot, slots
            self._allocate(slots * slot)

    def start(self, index: int) -> int:
        """Where bucket `index` of a sync goes."""
        return (index % self.slots) * self.slot

    def message(self, buckets: list[Bucket], indices: list[int]) -> bytes:
        """What the engine is sent to load `buckets[i]` for each of `indices`: their tensors' metadata (name, dtype,
        shape, byte offset), pickled once a plan and layout (a few microseconds a tensor), the same bytes each sync."""
        if self.described is not buckets:
            self.described, self.messages = buckets, {}
        key = tuple(indices)
        if key not in self.messages:
            if len(self.messages) > MAX_MESSAGES:  # the hand-overs grouped buckets in ever new runs: start over
                self.messages = {}
            metadata: list[dict] = []
            for index in indices:
                bucket, start = buckets[index], self.start(index)
                specs = zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.layout[0], strict=True)
                metadata += [
                    {"name": n, "dtype": d, "shape": torch.Size(s), "offset": start + o} for n, d, s, o in specs
                ]
            self.messages[key] = pickle.dumps(metadata)
        return self.messages[key]

    def _allocate(self, size: int) -> None:
        self.described, self.messages = None, {}  # their offsets change
        self.tensors = []  # the old ones go first: GPU memory
        for device in self.devices:
            tensor = torch.empty(size, dtype=torch.uint8, device=device)
            self.tensors.append(tensor if device.type == "cuda" else tensor.share_memory_())

    def handle(self, index: int):
        """What the engine maps: a CUDA IPC handle (rebuild function, arguments), or the CPU tensor pickled by
        torch.multiprocessing (its shared-memory file)."""
        tensor = self.tensors[index]
        return reduce_tensor(tensor) if tensor.is_cuda else bytes(ForkingPickler.dumps(tensor))


class Copies(Buffers):
    """--update-weight-mode delta: every bucket of one weight group's syncs, kept on each of the engine's devices as
    the base of the next sync's deltas (services/weightsync/delta.py), and room for one bucket's payload."""

    def __init__(self, devices: list[torch.device]):
        super().__init__(devices, budget=0)
        self.sizes: list[int] = []
        self.starts: list[int] = []
        self.version: int | None = None  # the version they hold, once a sync completed
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def fit(self, buckets: list[Bucket]) -> None:
        sizes = [bucket.layout[1] for bucket in buckets]
        if sizes != self.sizes:  # another plan: no base until a sync sends it whole
            self.version, self.sizes = None, sizes
            self.starts = list(accumulate([0, *sizes]))[:-1]
            self._allocate(sum(sizes))
            self.scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=self.devices[0])

    def start(self, index: int) -> int:
        return self.starts[index]


def ipc_request(handles: dict[str, str], flush_cache: bool, version: str | None) -> dict:
    """The body of SGLang's /update_weights_from_ipc: each engine GPU's ZMQ address by its device key."""
    return {"zmq_handles": handles, "flush_cache": flush_cache, "weight_version": version}


class EngineRoute:
    """One route of the engine, POSTed JSON to: a connection a call, by the standard library's client (httpx's took
    about 0.3 ms longer to read the engine's reply, on the sync's critical path); a TLS context is made once."""

    def __init__(self, url: str, path: str, headers: dict[str, str]):
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port, parts.path.rstrip("/") + path
        self.headers = {"Content-Type": "application/json", **headers}
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None

    def post(self, body: dict, timeout_s: float) -> dict:
        """The engine's JSON answer, or {"success": False, "message": why there is none}."""
        if self.tls is None:
            connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        else:
            connection = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.tls)
        try:
            connection.request("POST", self.path, json.dumps(body), self.headers)
            reply = connection.getresponse()
            data = reply.read()
            return json.loads(data) if data else {"success": reply.status < 400, "message": reply.reason}
        except (OSError, http.client.HTTPException, ValueError) as e:
            return {"success": False, "message": f"{type(e).__name__}: {e}"}
        finally:
            connection.close()


class Sync:
    """Streams one sync's `buckets` from `group` into the engine behind `engine`; `run()` returns when the engine
    has loaded them all, or raises saying why not."""

    def __init__(
        self,
        group,
        cancelled: threading.Event,
        buckets: list[Bucket],
        buffers: Buffers,
        engine: EngineRoute,
        version: str | None,
        flush_cache: bool,
        timeout_s: float,
        delta: dict | None = None,
    ):
        self.group, self.cancelled, self.buckets, self.buffers = group, cancelled, buckets, buffers
        self.delta = delta  # {version, base_version}: the buckets come as deltas to `buffers` (Copies) or whole
        self.engine, self.version, self.flush_cache = engine, version, flush_cache
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.sockets: list[zmq.Socket] = []
        self.waiting: list[bool] = []  # per socket: a message is out and its answer not read yet
        self.call: Future | None = None
        self.posted: dict = {}  # each bucket's receive, posted and not yet seen complete
        self.posted_up_to = -1
        self.waited = {"engine": 0.0, "broadcasts": 0.0}  # seconds this sync waited for each

    def run(self) -> None:
        if self.buffers.devices[0].type == "cuda":  # this thread's collectives and copies run on the engine's GPU
            torch.cuda.set_device(self.buffers.devices[0])
        base = (self.delta or {}).get("base_version", 0)
        if base and self.buffers.version != base:
            raise RuntimeError(
                f"this receiver holds version {self.buffers.version} as its base, not {base}, which "
                "the sync's deltas are against"
            )
        context = zmq.Context.instance()
        handles = {}
        for device in self.buffers.devices:
            socket = context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            address = f"ipc://@slipstream-receiver-{os.getpid()}-{next(_sockets)}"
            socket.bind(address)
            self.sockets.append(socket)
            self.waiting.append(False)
            handles[device_key(device)] = address
        with ThreadPoolExecutor(1) as pool:
            # The engine's call first: its side takes longest to be ready (the call, its update lock, the connection).
            self.call = pool.submit(self._post, handles)
            try:
                self.buffers.fit(self.buckets)
                # Then the first receives, as the trainer's first buckets wait for them. A sync given up already still
                # calls the engine, which is told at once (_stream) and ends its update.
                if self.delta is None and not self.cancelled.is_set():
                    self._post_receives(loaded=-1)
                self._stream()
            except BaseException as e:
                self._tell_engine(e)
                raise
            finally:
                for socket in self.sockets:
                    socket.close()
            reply = self.call.result()
        if not reply.get("success", False):
            raise RuntimeError(f"the engine's /update_weights_from_ipc failed: {reply.get('message', reply)}")

    def _stream(self) -> None:
        self._send_all([pickle.dumps(self.buffers.handle(i)) for i in range(len(self.sockets))])
        self._answers()
        if self.delta is None:
            self._stream_whole()
        else:
            self._stream_deltas()
        self._send_all([NONE] * len(self.sockets))  # the buffer is let go
        self._answers()
        self._send_all([NONE] * len(self.sockets))  # the post-load hook (checkpoint-engine 0.4.2)
        self._answers(or_done=True)  # an older worker (0.1.2) stopped at the first None: its call has ended

    def _stream_whole(self) -> None:
        """Every bucket whole, into the slots: a receive is posted once the engine loaded what its slot held (the
        first ones before the engine connected), and the engine is handed every bucket received since its last answer
        in one message (the protocol answers each message before the next), so the transfer goes on while it loads
        and an exchange costs once per batch."""
        count, posted, received, loading = len(self.buckets), self.posted, [], []
        loaded = -1  # every bucket up to `loaded` is in the engine
        while loaded < count - 1:
            arrived = min(posted, default=None)
            if loading and self._answered():
                loaded, loading = loading[-1], []
            elif arrived is not None and posted[arrived].is_completed():
                posted.pop(arrived).wait()
                received.append(arrived)
            elif received and not loading:  # before posting the next receives: the engine waits for it, the trainer not
                self._hand_over(received)
                loading, received = received, []
            elif not self._post_receives(loaded):
                self._idle("engine" if loading else "broadcasts")

    def _post_receives(self, loaded: int) -> bool:
        """Posts the receive of each next bucket whose slot is free: the engine loaded what it held (every bucket up to
        `loaded`); whether it posted any."""
        posted = self.posted_up_to
        while self.posted_up_to + 1 < len(self.buckets) and self.posted_up_to + 1 - self.buffers.slots <= loaded:
            self.posted_up_to += 1
            start, size = self.buffers.start(self.posted_up_to), self.buckets[self.posted_up_to].layout[1]
            into = self.buffers.tensors[0][start : start + size]
            self._live()
            self.posted[self.posted_up_to] = dist.broadcast(into, src=0, group=self.group, async_op=True)
        return self.posted_up_to > posted

    def _stream_deltas(self) -> None:
        """Bucket by bucket: each one's header says how much follows."""
        for index, bucket in enumerate(self.buckets):
            start, size = self.buffers.start(index), bucket.layout[1]
            self._receive(bucket, self.buffers.tensors[0][start : start + size])
            if index:
                self._answers()  # the engine loaded the previous bucket
            self._hand_over([index])
        if self.buckets:
            self._answers()

    def _hand_over(self, indices: list[int]) -> None:
        """Tells the engine of received buckets, once they are on every one of its GPUs."""
        if len(self.buffers.tensors) > 1:  # the engine's other GPUs: their own copy, from the first
            for index in indices:
                start, size = self.buffers.start(index), self.buckets[index].layout[1]
                first, *others = (tensor[start : start + size] for tensor in self.buffers.tensors)
                for other in others:
                    other.copy_(first)
            for tensor in self.buffers.tensors:  # the copies done (each bucket's broadcast is: its work completed)
                if tensor.is_cuda:  # the current stream: a device synchronize would wait for the receives posted ahead
                    torch.cuda.current_stream(tensor.device).synchronize()
        self._send_all([self.buffers.message(self.buckets, indices)] * len(self.sockets))

    def _answered(self) -> bool:
        """Whether every engine GPU answered the last message (read if so), without waiting."""
        for i, socket in enumerate(self.sockets):
            if self.waiting[i] and socket.poll(0):
                answer = socket.recv()
                self.waiting[i] = False
                if answer:
                    raise RuntimeError(f"the engine could not load a bucket: {answer.decode(errors='replace')}")
        return not any(self.waiting)

    def _live(self) -> None:
        """Raises once the group is destroyed (the gateway gave up): nothing more is posted on it, or waited for."""
        if self.cancelled.is_set():
            raise RuntimeError("the weight update group was destroyed while streaming")

    def _idle(self, waiting_for: str) -> None:
        self._still_waiting(waiting_for)
        started = time.perf_counter()
        time.sleep(0.0001)
        self.waited[waiting_for] += time.perf_counter() - started

    def _still_waiting(self, waiting_for: str) -> None:
        """Raises once the wait is over: the engine's call ended, the group was destroyed, or the deadline passed."""
        if self.call.done():
            raise RuntimeError(f"the engine's update ended early: {self.call.result().get('message')}")
        self._live()
        if time.monotonic() > self.deadline:
            raise RuntimeError(
                f"nothing came from the {'engine' if waiting_for == 'engine' else 'trainer'} within "
                f"{self.timeout_s:.0f} s"
            )

    def _receive(self, bucket: Bucket, into: torch.Tensor) -> None:
        """Bucket `bucket`, whole or as the changes to what `into` holds (its header says which); checked against the
        sender's checksums after a delta."""
        head = torch.empty(2 + len(bucket.names), dtype=torch.int64, device=into.device)
        self._broadcast(head)
        kind, changed = head[:2].tolist()
        if kind == weight_delta.FULL:
            return self._broadcast(into)
        payload = self.buffers.scratch[: weight_delta.payload_size(kind, changed, into.numel())]
        self._broadcast(payload)
        weight_delta.apply(kind, changed, payload, into)
        wrong = (weight_delta.checksums(into, bucket.layout[0], bucket.sizes) != head[2:]).nonzero().view(-1)
        if wrong.numel():
            raise RuntimeError(
                f"{bucket.names[int(wrong[0])]} differs from the trainer's after its delta: this "
                f"receiver's base was not version {self.delta['base_version']}"
            )

    def _broadcast(self, into: torch.Tensor) -> None:
        started = time.perf_counter()
        self._live()
        wait_for([dist.broadcast(into, src=0, group=self.group, async_op=True)], self.cancelled, self.deadline)
        self.waited["broadcasts"] += time.perf_counter() - started

    def _post(self, handles: dict) -> dict:
        return self.engine.post(ipc_request(handles, self.flush_cache, self.version), self.timeout_s)

    def _send_all(self, messages: list[bytes]) -> None:
        """Sends each engine GPU its message: a pickled object, what checkpoint-engine's worker reads by recv_pyobj."""
        for i, (socket, message) in enumerate(zip(self.sockets, messages, strict=True)):
            while True:  # a REQ socket's send waits for a peer: one that never connects, or died, must end it
                try:
                    socket.send(message, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:  # polled for: a retried send would see a new peer only a millisecond later
                    started = time.perf_counter()
                    socket.poll(POLL_MS, zmq.POLLOUT)
                    self.waited["engine"] += time.perf_counter() - started
                    self._still_waiting("engine")
            self.waiting[i] = True

    def _answers(self, or_done: bool = False) -> None:
        """Each engine GPU's answer to the last message: b"" (done) or the error's text."""
        started = time.perf_counter()
        try:
            self._read_answers(or_done)
        finally:
            self.waited["engine"] += time.perf_counter() - started

    def _read_answers(self, or_done: bool) -> None:
        for i, socket in enumerate(self.sockets):
            while not socket.poll(POLL_MS):
                if self.call.done():
                    if or_done:
                        return
                    raise RuntimeError(f"the engine's update ended early: {self.call.result().get('message')}")
                self._live()
                if time.monotonic() > self.deadline:
                    raise RuntimeError(f"the engine did not answer within {self.timeout_s:.0f} s")
            answer = socket.recv()
            self.waiting[i] = False
            if answer:
                raise RuntimeError(f"the engine could not load a bucket: {answer.decode(errors='replace')}")

    def _tell_engine(self, error: BaseException) -> None:
        """Ends the engine's side with the error, so that its update ends now and the next sync finds it free (the
        engine waits for the next message until its own deadline, minutes, and takes one update at a time). The error
        goes where the engine waits for a message: after the answer still due, and to an engine that has not
        connected yet once it does. Ends when the engine's call ended or at the sync's timeout."""
        until = time.monotonic() + self.timeout_s
        for i, socket in enumerate(self.sockets):
            socket.setsockopt(zmq.LINGER, 1000)  # the message goes out before the socket closes
            while not self.call.done() and time.monotonic() < until:
                if self.waiting[i]:  # the engine answers once done with the last message
                    if socket.poll(POLL_MS):
                        socket.recv()
                        self.waiting[i] = False
                    continue
                try:
                    socket.send_pyobj(RuntimeError(str(error)), flags=zmq.NOBLOCK)
                    break
                except zmq.Again:  # no engine connected yet
                    time.sleep(POLL_MS / 1000)
                except zmq.ZMQError:  # the socket cannot send: the engine's wait ends at its deadline
                    break
