"""Streamed through the weight receiver beside each engine (services/receiver): the receivers are the weight group's
members (one rank each); a sender's whole plan (every bucket's names, dtypes and shapes) goes first, then each bucket
is broadcast as one uint8 tensor at aligned offsets (`group.bucket_layout`), with no answer awaited between buckets.

The gateway's half: a sender's whole plan (in one message, or a message a bucket) goes to every receiver in one
/receive_weights call once complete, and the receivers answer once their engines loaded every bucket, fed through
SGLang's /update_weights_from_ipc. Buckets sent a message each are answered at once but for the last. The last
sender's whole plan carries the sync's version, which the engines take with a load that succeeded: the commit has no
version to post.

The trainer's half: the plan in one message (a lone sender's with PrepareWeightSync, whose answer says the receivers
have it: its stream then only asks for the answer). Two staging buffers (`tensors.Staging`): bucket k is written into
buffer k % 2 once bucket k - 2's broadcast completed (the receivers keep more). The gateway answers the plan once
every engine loaded the sync (a lone sender's plan: and it committed the version); a failure answer ends the sync at
once. The first sync of a run knows no plan yet (the buckets are formed as the weights are converted): each bucket
goes as a plan of its own (num_buckets 0), answered before the next, and the plan is known from then on."""

import contextlib
import queue
import threading
import time
from urllib.parse import urlsplit, urlunsplit

from services.common.errors import FailedPrecondition
from services.weightsync import halves
from services.weightsync.protocol import EnginesLeft
from slipstream.v1 import rollout_pb2

POLL_S = 0.0005  # how often a wait for a broadcast looks at the gateway's answers


class Gateway(halves.Gateway):
    kind, name = rollout_pb2.WEIGHT_TRANSPORT_STREAMED, "streamed"
    streamed = True
    takes_delta = True

    @classmethod
    def of(cls, config, engines: list, adapters=None) -> "Gateway":
        if config.weight_receiver_port_offset is None:
            raise FailedPrecondition(
                "the trainer streams weights through the weight receivers (--update-weight-transport streamed): "
                "start the gateway with --weight-receiver-port-offset, a `slipstream receiver` beside each engine"
            )
        return cls(config.weight_receiver_port_offset)

    def __init__(self, port_offset: int):
        self.port_offset = port_offset
        self.plans: dict[str, list[dict]] = {}  # each sender's buckets so far, by its group
        self.delta: dict | None = None  # --update-weight-mode delta: this sync's version and base version (0: none)
        self.version, self.waiting = None, set()  # the sync's, and the groups whose whole plan has not gone yet

    def open(self, version: int, groups: list[str]) -> None:
        self.version, self.waiting = version, set(groups)

    @property
    def labelled(self) -> bool:  # every sender's whole plan went, the last with the version
        return self.version is not None and not self.waiting

    def member(self, engine) -> tuple[str, int]:
        return receiver_url(engine.url, self.port_offset), 1

    def target(self, engine) -> str:
        return receiver_url(engine.url, self.port_offset)

    def requests(self, engines: list, bucket) -> tuple[str, dict] | None:
        if bucket.plan:  # the whole plan in one message
            plan = [{"names": n, "dtypes": d, "shapes": s} for n, d, s in bucket.plan]
        else:  # a bucket's specs a message
            plan = self.plans.setdefault(bucket.group_name, [])
            plan.append({"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes})
            if len(plan) < bucket.num_buckets:  # 0: a plan of one (a sender's first sync, before it knows its plan)
                return None
            del self.plans[bucket.group_name]
        body = {"group_name": bucket.group_name, "buckets": plan}
        if self.delta is not None:
            body["delta"] = self.delta
        if bucket.plan or bucket.num_buckets:  # the sender's whole plan
            self.waiting.discard(bucket.group_name)
            # The last plan takes the version: SGLang sets it once the load succeeded, and nothing is left to load.
            if self.labelled:
                body["weight_version"] = str(self.version)
        return "/receive_weights", {e.url: body for e in engines}


def receiver_url(engine_url: str, port_offset: int) -> str:
    """The receiver beside the engine at `engine_url`: the same host, on the engine's port plus the offset."""
    parts = urlsplit(engine_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return urlunsplit((parts.scheme, f"{host}:{port + port_offset}", "", "", ""))


class Sender(halves.Sender):
    takes_views = True  # each is copied into its place in the staging buffer (flatten_aligned)

    def __init__(self, *args):
        import torch

        from services.weightsync.tensors import Staging

        super().__init__(*args)
        sender, layout = self.sender, self.sender.layout
        self.planned = layout is not None
        if self.planned:  # the plan, at once, in one message: answered once the engines loaded every bucket
            lone = sender.senders is None  # then the gateway commits with its answer: no round trip of its own
            taken = self.prepared.plan_taken  # it went with Prepare, and the receivers have it already
            self.requests.put(
                rollout_pb2.WeightBucket(
                    version=self.version,
                    group_name=sender.group_name,
                    num_buckets=len(layout),
                    plan=[] if taken else sender.plan,
                    planned=taken,
                    commit=lone,
                )
            )
        self.expected = int(self.planned)  # answers still due
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="weight-sync-answers", daemon=True).start()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        # --update-weight-mode delta: a header before each bucket, which goes as the changes to the sender's copy of
        # it where every engine holds that copy's version (the gateway's answer), else whole. A bucket's changes are
        # counted on the GPU and sent once the next bucket is converted, so the count never makes the CPU wait.
        self.delta = sender.config.update_weight_mode == "delta"
        self.base = self.delta and sender.copies_version and sender.copies_version == self.prepared.delta_base_version
        self.pending: tuple | None = None  # delta: the bucket compared and not sent yet
        sender.copies_version = 0  # the copies change from now on
        sender.timings.update(words=0, changed_words=0)
        stages = 3 if self.delta else 2  # staging buffers: one converting, (delta) one pending, one broadcast
        staging = sender.kept.pop(Sender, None)
        if staging is None or not staging.fits(layout, stages, self.device):
            staging = None  # the last one's buffers go before the new ones are made
            staging = Staging(layout or [], stages, self.device)
        self.staging = sender.kept[Sender] = staging
        self.works: list = []  # each bucket's broadcast

    def send(self, index: int, specs: list, tensors) -> None:
        from services.weightsync.group import bucket_layout, flatten_aligned
        from services.weightsync.tensors import types

        stages = self.staging.stages
        if index >= stages:
            self._wait(self.works[index - stages], index - stages)  # its staging buffer is free again
        if self.planned:
            dtypes, shapes = self.staging.types[index]
            flat = self.staging.write(index, tensors)
        else:  # a plan of its own, answered before the next
            dtypes, shapes = types(specs)
            self.requests.put(
                rollout_pb2.WeightBucket(
                    version=self.version, bucket_index=index, tensors=specs, group_name=self.sender.group_name
                )
            )
            self.expected += 1
            flat = flatten_aligned(tensors, dtypes, shapes, self.staging.fit(index, bucket_layout(dtypes, shapes)[1]))
        self.sender.attempt.in_flight = True
        if self.delta:
            pending, self.pending = self.pending, self._compare(index, flat, dtypes, shapes)
            if pending is not None:
                self._broadcast(pending[0], self._delta(*pending))
        else:
            self._broadcast(index, [flat])
        self.watchdog.progress(f"streaming bucket {index}")
        if not self.planned:  # its answer before the next (it may come while the broadcast is still reported busy)
            self._flush()
            self._wait(self.works[index], index)
            self._answers_due()

    def _broadcast(self, index: int, tensors: list) -> None:
        import torch.distributed as dist

        try:
            for tensor in tensors:
                work = dist.broadcast(tensor, src=0, group=self.sender.group, async_op=True)
            self.works.append(work)
        except RuntimeError as e:  # a member is gone
            self.sender._drop_group()
            raise EnginesLeft(f"at bucket {index}: {e}") from None

    def _flush(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._broadcast(pending[0], self._delta(*pending))

    def _compare(self, index: int, flat, dtypes: list, shapes: list) -> tuple:
        """Bucket `index`'s checksums and, against the sender's copy of it, its changes, counted on the GPU: the count
        comes to the host when the GPU gets there, without waiting for it."""
        import torch

        from services.weightsync import delta as weight_delta
        from services.weightsync.group import bucket_layout
        from services.weightsync.tensors import has_copy

        copies = self.sender.copies
        sizes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in zip(dtypes, shapes, strict=True)]
        sums = weight_delta.checksums(flat, bucket_layout(dtypes, shapes)[0], sizes)
        mask = count = None
        if self.base and has_copy(copies, index, flat):
            mask, on_device = weight_delta.changes(flat, copies[index])
            count = torch.empty(1, dtype=on_device.dtype, pin_memory=flat.is_cuda)
            count.copy_(on_device.view(1), non_blocking=True)
        done = torch.cuda.Event() if flat.is_cuda else None
        if done is not None:
            done.record()
        return index, flat, sums, mask, count, done

    def _delta(self, index: int, flat, sums, mask, count, done) -> list:
        """The header and the payload of a compared bucket (services/weightsync/delta.py); the bucket becomes the
        sender's copy of it."""
        from services.weightsync import delta as weight_delta
        from services.weightsync.tensors import has_copy

        copies, timings = self.sender.copies, self.sender.timings
        if mask is None:
            kind, changed = weight_delta.FULL, flat.numel() // 2
        else:
            if done is not None:
                done.synchronize()  # long done: the next bucket was converted meanwhile
            changed = int(count[0])
            kind = weight_delta.smallest(changed, flat.numel())
        payload = weight_delta.payload(kind, flat, mask, changed)
        timings["words"] += flat.numel() // 2
        timings["changed_words"] += changed
        if has_copy(copies, index, flat):
            copies[index].copy_(flat)
        else:
            del copies[index:]  # another layout: the copies are made anew
            copies.append(flat.clone())
        return [weight_delta.header(kind, changed, sums), payload]

    def finish(self) -> None:
        self._flush()
        for index, work in enumerate(self.works):
            self._wait(work, index)
        started = time.perf_counter()
        self._answers_due()
        self.sender.timings["answers_s"] = time.perf_counter() - started

    def _answers_due(self) -> None:
        """Reads every answer still due: those not read already while a broadcast was awaited."""
        while self.expected:
            self._check(self._next_answer(None))

    def _wait(self, work, index: int) -> None:
        """Waits for a broadcast, ending early when the gateway answers that an engine failed."""
        started = time.perf_counter()
        while not work.is_completed():
            with contextlib.suppress(queue.Empty):
                self._check(self._next_answer(POLL_S))
        work.wait()
        timings = self.sender.timings
        timings["waited_s"] = timings.get("waited_s", 0.0) + time.perf_counter() - started
        self.watchdog.progress(f"after bucket {index}")

    def _next_answer(self, timeout: float | None):
        answer = self.answers.get(timeout=timeout)
        if isinstance(answer, BaseException):
            raise answer
        self.expected -= 1
        return answer

    def _check(self, result: rollout_pb2.WeightBucketResult) -> None:
        if result.committed:  # the commit's results, whose failures the commit weighs
            self.commit_results = list(result.engines)
            return
        try:
            self.sender._check(result)
        except EnginesLeft:
            self.sender._drop_group()  # the others' receives may never end: the group is aborted
            raise

    def _read(self) -> None:
        try:
            for answer in self.responses:
                self.answers.put(answer)
        except BaseException as e:  # the stream's error (the gateway aborted the sync, or went away)
            self.answers.put(e)
        else:  # answers still awaited never come
            self.answers.put(EnginesLeft("the gateway ended the bucket stream before answering every bucket"))
