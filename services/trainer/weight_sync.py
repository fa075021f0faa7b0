"""The trainer's side of weight sync: after a step, the full weights (gathered over tensor-parallel ranks, converted
to HF names) go to every engine over the weight group the gateway sets up, in buckets of `--update-weight-buffer-size`
MiB: the bucket's specs go to the gateway, which posts them to all engines, while rank 0 broadcasts the tensors.
With pipeline stages, each stage sends its own layers over its own weight group (see WeightSender).

No sync can hang the trainer: broadcasts are asynchronous, every wait has a deadline, a broken group is aborted (NCCL
ends its kernels) rather than destroyed, and a watchdog ends a sync that stops making progress."""

import contextlib
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
import torch.multiprocessing

from services.common.clients import Credentials, open_channel
from services.trainer.export import copy_hf_metadata, write_index
from services.weightsync import factory, halves
from services.weightsync.group import abort_group, destroy_group, end_group, init_custom_process_group
from services.weightsync.protocol import (
    SENDER_MOVES,
    EnginesLeft,
    GatewayLeft,
    SenderPhase,
    Unreachable,
    WeightSyncFailed,
)
from slipstream.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

GROUP_NAME = "slipstream_weights"
ATTEMPTS = 3  # an engine that leaves mid-sync costs one attempt; the others get the weights from the start again
STALL_FACTOR = 1.5  # the gateway's deadline for an engine call is weight_sync_timeout_s: its answer comes first
GRACE_S = 30.0  # after the watchdog aborted a stalled sync, the sync must return within this
STALLED_EXIT_CODE = 75


class SendAttempt:
    """One attempt at sending `version`, with everything that lives only as long as it: its phase, the bucket stream
    (the watchdog cancels it), the gateway's choice of transport, whether broadcasts are in flight (the group is then
    aborted, not destroyed), whether colocated peers wait in the next hand-over, and its timings."""

    def __init__(self, version: int, peers_waiting: bool):
        self.version, self.phase = version, SenderPhase.PREPARING
        self.stream = None
        self.transport: halves.Sender | None = None
        self.in_flight = False  # broadcasts were started on the group and not all have completed
        self.peers_waiting = peers_waiting  # the sender's: the colocated peers wait in the next bucket's hand-over
        # prepare_s, send_s, commit_s; streamed, within send_s: waited_s (for broadcasts to complete) and answers_s
        # (after the last broadcast, for the engines to load)
        self.timings: dict[str, float] = {}

    def move(self, to: SenderPhase) -> None:
        if to not in SENDER_MOVES[self.phase]:
            raise RuntimeError(f"weight sync of version {self.version}: no move from {self.phase.value} to {to.value}")
        self.phase = to
        if to is SenderPhase.SENT:  # every broadcast completed, and the peers are past the last bucket
            self.in_flight = self.peers_waiting = False

    def end(self, failure: Exception | None) -> None:
        if self.phase not in (SenderPhase.COMMITTED, SenderPhase.FAILED):
            self.move(SenderPhase.FAILED if failure is not None else SenderPhase.COMMITTED)


class WeightSender:
    """Every rank of data-parallel replica 0 iterates the weights (the TP gather is collective); a sender talks to
    the gateway and broadcasts. `weights()` yields this rank's (HF name, full tensor) pairs in order; `peers` is the
    group of the ranks iterating with the senders (None when one sender is alone).

    With pipeline stages every stage's first rank is a sender of its own layers (`senders`: their group, the
    pipeline group of replica 0), each rank 0 of its own weight group with every engine: no stage's layers travel
    through another, the stages convert and gather in parallel, and each sends from its own GPU (and, across nodes,
    its own network). The first sender (global rank 0) coordinates: it prepares the sync for all and commits once
    every sender is done; the senders share each outcome, so that they start over, give up or go on together."""

    def __init__(
        self,
        config,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        sender: bool,
        peers=None,
        senders=None,
        views: Callable[[], list | None] | None = None,
    ):
        self.config, self.weights, self.sender, self.peers, self.senders = config, weights, sender, peers, senders
        self.views = views  # the weights as views of the parameters (models.WeightViews), where no conversion is due
        self.viewed: tuple = (None, [])  # the views last used, in the layout's buckets
        self.coordinator = sender and (senders is None or dist.get_rank(senders) == 0)
        # Colocated on several GPUs, every rank hands the engines on its GPU its own copy of each bucket.
        self.handing_over = config.colocate and peers is not None
        self.group_name = _group_name(dist.get_rank(senders) if senders is not None else None)
        self.address = config.weight_sync_address if self.coordinator else _own_address(config.weight_sync_address)
        self.group, self.port = None, 0
        self.listener: socket.socket | None = None  # the weight group's store port, held from Prepare to the join
        self.attempt: SendAttempt | None = None  # the current or last one
        self.layout: list | None = None  # each bucket's tensor specs, known after the first sync
        self.plan: list[rollout_pb2.BucketSpecs] = []  # the layout as a streamed sync's plan, made once
        self.kept: dict = {}  # by transport: what its sender half keeps from one sync to the next (only the last's)
        # --update-weight-mode delta: each bucket as last sent (the receivers keep the same), and its version once
        # a planned sync of it committed: the base of the next sync's deltas
        self.copies: list[torch.Tensor] = []
        self.copies_version = 0
        self.timeout = timedelta(seconds=config.weight_sync_timeout_s)
        # torch's own deadline on the group's collectives comes last: it ends the process
        self.collective_timeout = self.timeout * STALL_FACTOR * 2
        # Longer than the gateway's deadline for an engine: it answers (having evicted a hung engine) before this ends.
        self.rpc_timeout_s = config.weight_sync_timeout_s * STALL_FACTOR
        # The bucket stream lasts as long as the sync: no per-method default deadline on this channel.
        credentials = Credentials.of(config, "trainer")
        self.channel = open_channel(config.rollout_addr, credentials) if sender else None
        if config.colocate and not torch.cuda.is_available():  # CPU tensors go by shared-memory file name
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.gateway = rollout_pb2_grpc.RolloutServiceStub(self.channel) if sender else None
        if sender and not config.colocate:
            _check_reachable(self.address)

    @property
    def timings(self) -> dict[str, float]:
        """The last attempt's."""
        return self.attempt.timings if self.attempt is not None else {}

    @property
    def transport(self) -> "halves.Sender | None":
        """The last attempt's half of the gateway's choice (services/trainer/transports)."""
        return self.attempt.transport if self.attempt is not None else None

    def sync(self, version: int) -> bool:
        """Sends the weights as `version`; returns whether the engines serve it. An engine that fails is left out
        and the others get the weights from the start; when every attempt lost engines (none can take the policy),
        raises WeightSyncFailed with their errors. Other failures leave the engines on their version and return
        False: training goes on, and the next sync starts afresh."""
        for attempt in range(1, ATTEMPTS + 1):
            buckets = self._buckets(self.weights())
            failure = self._attempt(version, buckets) if self.sender else self._follow(buckets)
            if not self._agree(isinstance(failure, (EnginesLeft, GatewayLeft)) and attempt < ATTEMPTS):
                break
            if self.coordinator:
                log.warning("weight sync of version %d, attempt %d: %s; starting over", version, attempt, failure)
            if isinstance(failure, GatewayLeft):  # the channel's next pick is a gateway that answers
                time.sleep(attempt)
        if failure is None or not self.sender:
            return failure is None
        self._drop_group()
        if self.coordinator:
            with contextlib.suppress(grpc.RpcError):
                self.gateway.AbortWeightSync(
                    rollout_pb2.AbortWeightSyncRequest(version=version, reason=str(failure)), timeout=self.rpc_timeout_s
                )
        if isinstance(failure, Unreachable):
            raise WeightSyncFailed(str(failure))
        if isinstance(failure, EnginesLeft):
            raise WeightSyncFailed(f"weight sync of version {version} failed {ATTEMPTS} times; last: {failure}")
        log.warning("weight sync of version %d failed (%s); the engines keep their weights", version, failure)
        return False

    def _attempt(self, version: int, buckets) -> Exception | None:
        planned = self.layout is not None
        self.attempt = attempt = SendAttempt(version, peers_waiting=self.handing_over)
        watchdog = Watchdog(self.timeout.total_seconds() * STALL_FACTOR, self._stalled)
        with watchdog:
            try:
                failure = _failure(watchdog, self._send, attempt, buckets, watchdog)
            finally:
                if attempt.peers_waiting:  # they learn that this attempt ended
                    self._gather_handles([], [])
                    self._share_loaded(False)
                _drain(buckets)  # the peers take part in every gather, whatever happened here
            failure = self._settled(failure)
            if failure is None and self.coordinator:
                failure = _failure(watchdog, self._commit, attempt)
            failure = self._settled(failure)  # the coordinator's commit, to every sender
        attempt.end(failure)
        if failure is None and planned and self.config.update_weight_mode == "delta":
            self.copies_version = version
        if isinstance(failure, (EnginesLeft, GatewayLeft, Unreachable)):
            self._drop_group()
        return failure

    def _settled(self, failure: Exception | None) -> Exception | None:
        """Every sender's outcome, the same for all: the first failure in stage order (an engine that left one
        group left them all), or None."""
        if self.senders is None:
            return failure
        outcomes = [None] * dist.get_world_size(self.senders)
        mine = None if failure is None else (type(failure).__name__, str(failure))
        dist.all_gather_object(outcomes, mine, group=self.senders)
        kind, message = next((o for o in outcomes if o is not None), (None, None))
        kinds = {"EnginesLeft": EnginesLeft, "GatewayLeft": GatewayLeft, "Unreachable": Unreachable}
        return None if kind is None else kinds.get(kind, RuntimeError)(message)

    def _stalled(self) -> None:
        """The watchdog's remedy: whatever the sync waits in ends (a broadcast with the group, an answer with the
        stream)."""
        if self.group is not None:
            abort_group(self.group, self.collective_timeout.total_seconds())
        stream = self.attempt.stream if self.attempt is not None else None
        if stream is not None:
            stream.cancel()

    def _send(self, attempt: SendAttempt, buckets, watchdog: "Watchdog") -> None:
        grouped = factory.asked(self.config) == rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED
        started = time.perf_counter()
        prepared = self._prepare(attempt.version, grouped)
        if grouped and (prepared.group_created or self.group is None):
            watchdog.progress("joining the weight group")  # its own deadline, the timeout, ends first
            self._drop_group()
            self._join(prepared)
        watchdog.progress("after joining the weight group")
        attempt.timings["prepare_s"] = time.perf_counter() - started
        attempt.move(SenderPhase.SENDING)
        requests: queue.Queue = queue.Queue()
        responses = attempt.stream = self.gateway.SyncWeightBuckets(iter(requests.get, None), timeout=3600)
        try:
            attempt.transport = transport = factory.sender_half(
                self, prepared, attempt.version, requests, responses, watchdog
            )
            for index, (specs, tensors) in enumerate(buckets):
                transport.send(index, specs, tensors)
                watchdog.progress(f"after bucket {index}")
            transport.finish()
            attempt.move(SenderPhase.SENT)
        finally:
            requests.put(None)
            attempt.stream = None
        attempt.timings["send_s"] = time.perf_counter() - started - attempt.timings["prepare_s"]

    def _prepare(self, version: int, grouped: bool) -> rollout_pb2.PrepareWeightSyncResponse:
        """The coordinator prepares the sync for every sender's group (`grouped`: the weights go over one); a sender
        that lost its group offers a new address (port), for which the gateway builds new groups."""
        if self.group is None and grouped:
            self._listen()
        mine = rollout_pb2.WeightSource(master_address=self.address, master_port=self.port, group_name=self.group_name)
        sources = [mine]
        if self.senders is not None:
            sources = [None] * dist.get_world_size(self.senders)
            dist.all_gather_object(sources, mine, group=self.senders)
        answer = [b""]
        try:
            if self.coordinator:
                answer[0] = self.gateway.PrepareWeightSync(
                    rollout_pb2.PrepareWeightSyncRequest(
                        version=version,
                        sources=sources,
                        backend=group_backend(),
                        transport=factory.asked(self.config),
                        delta=self.config.update_weight_mode == "delta",
                        delta_base_version=self.copies_version,
                        plan=self.plan if grouped and self.senders is None else [],  # see Streamed
                    ),
                    timeout=self.rpc_timeout_s,
                ).SerializeToString()
        finally:  # the other senders wait for the answer, whatever it is
            if self.senders is not None:
                dist.broadcast_object_list(answer, src=dist.get_global_rank(self.senders, 0), group=self.senders)
        if not answer[0]:
            raise RuntimeError("the coordinator could not prepare the weight sync")
        return rollout_pb2.PrepareWeightSyncResponse.FromString(answer[0])

    def _listen(self) -> None:
        """The port the engines are told to join is bound and listening from now on, on every interface (engines on
        other hosts join it): a port merely found free can be taken by another process before the store binds it."""
        if self.listener is not None:
            self.listener.close()
        self.listener = socket.create_server(("", 0), backlog=128)
        self.port = self.listener.getsockname()[1]

    def _commit(self, attempt: SendAttempt) -> None:
        started, version = time.perf_counter(), attempt.version
        attempt.move(SenderPhase.COMMITTING)
        engines = attempt.transport.commit_results  # the gateway committed with its last answer
        if engines is None:
            attempt.transport.publish()
            engines = self.gateway.CommitWeightSync(
                rollout_pb2.CommitWeightSyncRequest(version=version), timeout=self.rpc_timeout_s
            ).engines
        attempt.timings["commit_s"] = time.perf_counter() - started
        live = sum(e.success for e in engines)
        if not live:  # every engine failed its commit (and was evicted): none serves this version
            raise EnginesLeft(
                f"no engine committed version {version}: " + "; ".join(f"{e.url}: {e.message}" for e in engines)
            )
        attempt.transport.committed()
        attempt.move(SenderPhase.COMMITTED)
        log.info("weights of version %d sent to %d engine(s) (%s)", version, live, attempt.transport.name)

    def _join(self, prepared: rollout_pb2.PrepareWeightSyncResponse) -> None:
        """Hosts the weight group as rank 0 and waits for the engines to join it."""
        address = f"{self.address}:{self.port}"
        # Each group on a port of its own, held since Prepare: the gateway never has a group rebuilt on a port hosted
        # before (it asks for a new one), whose old store may still listen, or another process may have taken.
        listener, self.listener = self.listener, None
        if listener is None:
            raise EnginesLeft("the gateway built a new weight group on the port of the old one")
        try:
            self.group = init_custom_process_group(
                group_backend(),
                f"tcp://{address}",
                prepared.world_size,
                0,
                self.group_name,
                self.timeout,
                self.collective_timeout,
                listen_fd=listener.detach(),
            )
        except dist.DistStoreError as e:
            if not re.search(r"\b1/\d+ clients joined", str(e)):  # some joined: the others left (EnginesLeft)
                raise
            raise Unreachable(
                f"no engine joined the weight group at {address} within {self.timeout.total_seconds():.0f} s "
                f"(engines {', '.join(engine.url for engine in prepared.engines)}): --weight-sync-address "
                f"{self.config.weight_sync_address} must be an address of the trainer's rank 0 that every engine "
                "reaches, on any port (in compose: the job's service name on the shared network; across hosts: the "
                "trainer host's address, with no firewall between them); docs/DEPLOY.md, 'Networking for the weight "
                "group'"
            ) from None

    def _answered(self, result: rollout_pb2.WeightBucketResult, works: list, watchdog: "Watchdog") -> None:
        """The gateway's answer for a bucket: every engine loaded it (so its broadcasts are done), or the group is
        broken and aborted (the broadcasts may never finish)."""
        watchdog.progress(f"after bucket {result.bucket_index}")
        try:
            self._check(result)
        except EnginesLeft:
            self._drop_group()
            raise
        for work in works:
            work.wait()

    def _hand_over(self, version: int, index: int, specs: list, tensors, requests: queue.Queue, responses) -> None:
        """Colocated: the bucket goes as tensor handles (CUDA IPC), one set per GPU: every rank's own copy, each
        engine reading those of its GPU. They must live until the engines copied them: every rank waits for the
        gateway's answer."""
        payloads = self._gather_handles(specs, tensors)
        try:
            requests.put(
                rollout_pb2.WeightBucket(
                    version=version,
                    bucket_index=index,
                    tensors=specs,
                    serialized_named_tensors=payloads,
                    group_name=self.group_name,
                )
            )
            self._check(next(responses))
        except BaseException:
            self._share_loaded(False)
            raise
        self._share_loaded(True)

    def _follow(self, buckets) -> None:
        """A peer's part in the sync: the gathers, and colocated on several GPUs the hand-over of its copy of each
        bucket, until the sender's attempt ends."""
        if self.handing_over:
            for specs, tensors in buckets:
                self._gather_handles(specs, tensors)
                if not self._share_loaded(None):
                    break
        _drain(buckets)

    def _gather_handles(self, specs: list, tensors) -> list[bytes]:
        """This rank's bucket as tensor handles, and at the sender every rank's, in rank (= GPU) order."""
        payload = bytes(ForkingPickler.dumps(list(zip([s.name for s in specs], tensors, strict=True))))
        if not self.handing_over:
            return [payload]
        payloads = [None] * dist.get_world_size(self.peers) if self.sender else None
        dist.gather_object(payload, payloads, dst=dist.get_global_rank(self.peers, 0), group=self.peers)
        return payloads

    def _share_loaded(self, loaded: bool | None) -> bool:
        """The sender tells the colocated peers whether the engines loaded the bucket (they go on to the next)."""
        if not self.handing_over:
            return bool(loaded)
        flag = [loaded]
        dist.broadcast_object_list(flag, src=dist.get_global_rank(self.peers, 0), group=self.peers)
        if self.sender:
            self.attempt.peers_waiting = bool(flag[0])
        return bool(flag[0])

    def hf_files(self, folder: Path, weight_map: dict[str, str], total: int) -> None:
        """Makes `folder`, holding a sync's shards, an HF checkpoint (the disk transport's): its index and the
        checkpoint's other files (config, tokenizer)."""
        write_index(folder, weight_map, total)
        copy_hf_metadata(self.config.hf_checkpoint, folder)

    def adapter_config(self, tensors: dict) -> dict:
        """The peft adapter_config.json of a sync's adapters (the LoRA transport's)."""
        from services.trainer import lora  # megatron's layers: only runs with LoRA need them here

        return lora.adapter_config(lora.settings_of(self.config), self.config.hf_checkpoint, tensors)

    def group_names(self) -> list[str]:
        """Every sender's group name, in stage order."""
        return (
            [GROUP_NAME] if self.senders is None else [_group_name(s) for s in range(dist.get_world_size(self.senders))]
        )

    def lagging(self, version: int) -> list[str]:
        """The healthy engines that do not serve `version` (re-admitted after a crash, or missed a sync)."""
        try:
            reply = self.gateway.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=self.timeout.total_seconds())
        except grpc.RpcError as e:
            log.warning("cannot list the engines: %s", e.details())
            return []
        return [
            e.url
            for e in reply.engines
            if e.state == rollout_pb2.ENGINE_STATE_HEALTHY and e.weight_version != str(version)
        ]

    def release(self) -> None:
        """Colocated: the engines free their GPU memory while this trainer trains (the next sync takes it back)."""
        if self.coordinator:
            request = rollout_pb2.ReleaseEngineMemoryRequest()
            self.gateway.ReleaseEngineMemory(request, timeout=self.rpc_timeout_s)

    @staticmethod
    def _check(result: rollout_pb2.WeightBucketResult) -> None:
        failed = [e for e in result.engines if not e.success]
        if failed:
            raise EnginesLeft(f"at bucket {result.bucket_index}: " + "; ".join(f"{e.url}: {e.message}" for e in failed))

    def _buckets(self, pairs):
        """(tensor specs, tensors) of about --update-weight-buffer-size bytes per bucket, in order. The first sync
        groups the converted tensors and keeps the layout; later ones send a bucket's specs first and convert each
        tensor just before its broadcast, so that conversion overlaps the transfer; a transport that takes views gets
        the parameters' views (`views`) as they are, with nothing converted."""
        takes_views = self.layout is not None and self.views and getattr(self.transport, "takes_views", False)
        views = self.views() if takes_views else None  # none on the first sync: it learns the layout
        if views is not None:
            if self.viewed[0] is not views:  # grouped as the layout, and checked against it, once
                pairs = iter(views)
                self.viewed = views, [[_viewed(spec, *next(pairs)) for spec in specs] for specs in self.layout]
            yield from zip(self.layout, self.viewed[1], strict=True)
            return
        if self.layout is not None:
            pairs = iter(pairs)
            for specs in self.layout:
                tensors = (_matching(spec, *next(pairs)) for spec in specs)
                yield specs, tensors
                for _ in tensors:  # what a failure mid-bucket left: converted all the same, as the peers gather it
                    pass
            return
        limit = self.config.update_weight_buffer_size
        layout, specs, tensors, size = [], [], [], 0
        for name, tensor in pairs:
            if specs and size + tensor.numel() * tensor.element_size() > limit:
                layout.append(specs)
                yield specs, tensors
                specs, tensors, size = [], [], 0
            dtype = str(tensor.dtype).removeprefix("torch.")
            specs.append(common_pb2.TensorSpec(name=name, dtype=dtype, shape=list(tensor.shape)))
            tensors.append(tensor.contiguous())
            size += tensor.numel() * tensor.element_size()
        if specs:
            layout.append(specs)
            yield specs, tensors
        self.layout, self.plan = layout, [rollout_pb2.BucketSpecs(tensors=specs) for specs in layout]

    def _agree(self, again: bool) -> bool:
        """The sender's decision to start over, shared with the peers (they gather with it once more)."""
        if self.peers is None:
            return again
        flag = [again]
        dist.broadcast_object_list(flag, src=dist.get_global_rank(self.peers, 0), group=self.peers)
        return bool(flag[0])

    def _drop_group(self) -> None:
        """With broadcasts in flight the group is aborted, not destroyed: destroying waits for them, and they may
        never finish."""
        if self.group is not None:
            in_flight = self.attempt is not None and self.attempt.in_flight
            end_group(self.group, in_flight, self.collective_timeout.total_seconds())
            self.group = None
            if self.attempt is not None:
                self.attempt.in_flight = False

    def close(self) -> None:
        """A group that is still here has no broadcast pending (a failed sync dropped it), so it is destroyed, which
        ends it at once (an aborted gloo group is kept until its transfers end)."""
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        if self.listener is not None:
            self.listener.close()
        if self.channel is not None:
            self.channel.close()


class Watchdog:
    """Ends a weight sync that stops making progress. After `timeout_s` without any, it calls `remedy` (abort the
    group, cancel the stream), which ends whatever the sync waits in; a sync that still has not returned `grace_s`
    later is stuck where nothing can reach it, and the process exits saying where, so that the run stops instead of
    hanging (a NCCL call stuck before its group could be aborted)."""

    def __init__(self, timeout_s: float, remedy: Callable[[], None], grace_s: float = GRACE_S):
        self.timeout_s, self.remedy, self.grace_s = timeout_s, remedy, grace_s
        self.last, self.where, self.stalled = time.monotonic(), "preparing", ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="weight-sync-watchdog", daemon=True)

    def progress(self, where: str) -> None:
        self.last, self.where = time.monotonic(), where

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 20)):
            idle = time.monotonic() - self.last
            if not self.stalled and idle > self.timeout_s:
                self.stalled = f"the weight sync made no progress for {idle:.0f} s ({self.where})"
                log.error("%s: aborting the weight group", self.stalled)
                self.remedy()
            elif self.stalled and idle > self.timeout_s + self.grace_s:
                log.critical("%s, and did not end once the group was aborted; the trainer stops", self.stalled)
                logging.shutdown()
                os._exit(STALLED_EXIT_CODE)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """The trainer hosts the weight group's rendezvous on a free port and connects to it at `address` itself, as the
    engines do: an address it cannot reach is a wrong setting, found here at start rather than at the first sync."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6) as server:
        try:
            socket.create_connection((address, server.getsockname()[1]), timeout=timeout_s).close()
        except OSError as e:
            raise ValueError(
                f"--weight-sync-address {address}: the trainer hosts the weight group there and cannot reach it itself "
                f"({e.strerror or e}); pass an address of this host that the engines reach (in compose: the job's "
                "service name; across hosts: this host's address)"
            ) from None


def _failure(watchdog: Watchdog, step: Callable, *args) -> Exception | None:
    """What `step` of a sync raised, as the sync's outcome: EnginesLeft where starting over may help."""
    try:
        step(*args)
    except (EnginesLeft, Unreachable) as e:
        return e
    except grpc.RpcError as e:
        restart = (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION)
        if watchdog.stalled or e.code() in restart:  # the gateway ended the sync, or the watchdog did
            return EnginesLeft(watchdog.stalled or f"the gateway answered {e.code().name}: {e.details()}")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return GatewayLeft(f"the gateway answered UNAVAILABLE: {e.details()}")
        return RuntimeError(f"the gateway answered {e.code().name}: {e.details()}")
    except RuntimeError as e:  # joining the group failed, or a broadcast did
        return EnginesLeft(watchdog.stalled or str(e))
    return None


def group_backend() -> str:
    """A weight group's collective backend."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _group_name(stage: int | None) -> str:
    return GROUP_NAME if stage is None else f"{GROUP_NAME}_pp{stage}"


def _own_address(coordinator_address: str) -> str:
    """Where a sender other than rank 0 hosts its weight group: rank 0's address on rank 0's node (torchrun's
    GROUP_RANK 0), else this host's name, which the engines must resolve (a pod's name under a headless Service)."""
    return coordinator_address if int(os.environ.get("GROUP_RANK", "0")) == 0 else socket.getfqdn()


def _drain(buckets) -> None:
    for _, tensors in buckets:
        for _ in tensors:
            pass


def _viewed(spec: common_pb2.TensorSpec, name: str, view: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    _same_layout(spec, name, shape)
    return view


def _matching(spec: common_pb2.TensorSpec, name: str, tensor: torch.Tensor) -> torch.Tensor:
    _same_layout(spec, name, tensor.shape)
    return tensor.contiguous()


def _same_layout(spec: common_pb2.TensorSpec, name: str, shape: torch.Size) -> None:
    if name != spec.name or list(shape) != list(spec.shape):
        raise ValueError(
            f"weights changed layout since the last sync: {name} {list(shape)} where {spec.name} {list(spec.shape)} was"
        )
