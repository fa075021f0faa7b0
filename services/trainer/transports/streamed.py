"""Streamed to the weight receivers beside the engines: the sync's whole plan (every bucket's specs) goes to the
gateway first, in one message (a lone sender's with PrepareWeightSync, whose answer says the receivers have it: its
stream then only asks for the answer), then each bucket is broadcast as one uint8 tensor at aligned offsets
(`bucket_layout`), with no answer awaited between buckets. Two staging buffers: bucket k is written into buffer k % 2
once bucket k - 2's broadcast completed (the receivers keep more). The gateway answers the plan once every engine
loaded the sync (a lone sender's plan: and it committed the version); a failure answer ends the sync at once.

The first sync of a run knows no plan yet (the buckets are formed as the weights are converted): each bucket goes as
a plan of its own (num_buckets 0), answered before the next, and the plan is known from then on."""

import contextlib
import queue
import threading
import time

import torch
import torch.distributed as dist

from services.common import weight_delta
from services.common.weight_group import bucket_layout, copy_all, flatten_aligned, places_of
from services.trainer.transports import EnginesLeft, Transport
from slipstream.v1 import rollout_pb2

POLL_S = 0.0005  # how often a wait for a broadcast looks at the gateway's answers


class Streamed(Transport):
    takes_views = True  # each is copied into its place in the staging buffer (flatten_aligned)

    def __init__(self, *args):
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
        staging = sender.kept.pop(Streamed, None)
        if staging is None or not staging.fits(layout, stages, self.device):
            staging = None  # the last one's buffers go before the new ones are made
            staging = Staging(layout or [], stages, self.device)
        self.staging = sender.kept[Streamed] = staging
        self.works: list = []  # each bucket's broadcast

    def send(self, index: int, specs: list, tensors) -> None:
        stages = self.staging.stages
        if index >= stages:
            self._wait(self.works[index - stages], index - stages)  # its staging buffer is free again
        if self.planned:
            dtypes, shapes = self.staging.types[index]
            flat = self.staging.write(index, tensors)
        else:  # a plan of its own, answered before the next
            dtypes, shapes = _types(specs)
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

    def _broadcast(self, index: int, tensors: list[torch.Tensor]) -> None:
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

    def _compare(self, index: int, flat: torch.Tensor, dtypes: list, shapes: list) -> tuple:
        """Bucket `index`'s checksums and, against the sender's copy of it, its changes, counted on the GPU: the count
        comes to the host when the GPU gets there, without waiting for it."""
        copies = self.sender.copies
        sizes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in zip(dtypes, shapes, strict=True)]
        sums = weight_delta.checksums(flat, bucket_layout(dtypes, shapes)[0], sizes)
        mask = count = None
        if self.base and _has_copy(copies, index, flat):
            mask, on_device = weight_delta.changes(flat, copies[index])
            count = torch.empty(1, dtype=on_device.dtype, pin_memory=flat.is_cuda)
            count.copy_(on_device.view(1), non_blocking=True)
        done = torch.cuda.Event() if flat.is_cuda else None
        if done is not None:
            done.record()
        return index, flat, sums, mask, count, done

    def _delta(self, index: int, flat: torch.Tensor, sums, mask, count, done) -> list[torch.Tensor]:
        """The header and the payload of a compared bucket (services/common/weight_delta.py); the bucket becomes the
        sender's copy of it."""
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
        if _has_copy(copies, index, flat):
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


class Staging:
    """The staging buffers of a layout's syncs, with each bucket's dtypes, shapes and places in them, made once and
    kept by the sender from one sync to the next (the last sync's transport held its buffers until the next anyway):
    a bucket is then written with a copy call or two and no view made."""

    def __init__(self, layout: list, stages: int, device):
        self.layout, self.stages, self.device = layout, stages, device
        self.types = [_types(specs) for specs in layout]
        self.layouts = [bucket_layout(*types) for types in self.types]  # each bucket's offsets and size
        size = max((size for _, size in self.layouts), default=0)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(stages)]
        self.places: dict[int, list[torch.Tensor]] = {}  # by bucket, in buffer index % stages

    def fits(self, layout: list | None, stages: int, device) -> bool:
        """Whether it serves a sync of `layout` (None: a sync with no plan yet, which grows the buffers it needs)."""
        return (layout is None or layout is self.layout) and self.stages == stages and self.device == device

    def write(self, index: int, tensors) -> torch.Tensor:
        """Bucket `index` of the layout written into its buffer; the bucket's part of it."""
        buffer, (offsets, size), tensors = self.buffers[index % self.stages], self.layouts[index], list(tensors)
        if index not in self.places:
            self.places[index] = places_of(buffer, tensors, self.types[index][0], offsets)
        copy_all(self.places[index], tensors)
        return buffer[:size]

    def fit(self, index: int, size: int) -> torch.Tensor:
        """Bucket `index`'s buffer, of at least `size` bytes (a sync with no plan yet: its buckets' sizes come one by
        one)."""
        stage = index % self.stages
        if self.buffers[stage].numel() < size:
            self.buffers[stage] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[stage]


def _has_copy(copies: list[torch.Tensor], index: int, flat: torch.Tensor) -> bool:
    """Whether the sender holds a copy of bucket `index` as laid out now."""
    return index < len(copies) and copies[index].numel() == flat.numel()


def _types(specs: list) -> tuple[list[torch.dtype], list[list[int]]]:
    return [getattr(torch, s.dtype) for s in specs], [list(s.shape) for s in specs]
