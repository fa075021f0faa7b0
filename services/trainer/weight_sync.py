"""The trainer's side of weight sync: after a step, the full weights (gathered over tensor-parallel ranks, converted
to HF names) go to every engine over the weight group the gateway sets up, in buckets of `--update-weight-buffer-size`
MiB: the bucket's specs go to the gateway, which posts them to all engines, while rank 0 broadcasts the tensors."""

import contextlib
import logging
import queue
import socket

import grpc
import torch
import torch.distributed as dist

from services.common.clients import open_channel
from services.common.weight_group import flatten, init_custom_process_group
from slipstream.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

GROUP_NAME = "slipstream_weights"


class WeightSender:
    """Every rank of data-parallel replica 0 iterates the weights (the TP gather is collective); its global rank 0
    talks to the gateway and broadcasts."""

    def __init__(self, config, model, gpt, sender: bool):
        self.config, self.model, self.gpt, self.sender = config, model, gpt, sender
        self.group = None
        self.port = _free_port() if sender else 0
        self.channel = open_channel(config.rollout_addr) if sender else None
        self.gateway = rollout_pb2_grpc.RolloutServiceStub(self.channel) if sender else None

    def sync(self, version: int) -> None:
        from services.trainer.models import hf_weights_of

        buckets = self._buckets(hf_weights_of(self.model, self.gpt))
        if not self.sender:
            for _ in buckets:  # the TP peers take part in the gathers, and only in them
                pass
            return
        try:
            self._send(version, buckets)
        except (grpc.RpcError, RuntimeError) as e:
            reason = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.warning("weight sync of version %d failed (%s); the engines keep the previous weights", version, reason)
            if self.group is not None:  # the next sync starts from a fresh group
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(self.group)
                self.group = None
            with contextlib.suppress(grpc.RpcError):
                self.gateway.AbortWeightSync(rollout_pb2.AbortWeightSyncRequest(version=version, reason=reason))

    def _buckets(self, pairs):
        """Lists of (HF name, tensor) of about --update-weight-buffer-size MiB each, in order."""
        limit = self.config.update_weight_buffer_size * 1024 * 1024
        bucket, size = [], 0
        for name, tensor in pairs:
            if bucket and size + tensor.numel() * tensor.element_size() > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.contiguous()))
            size += tensor.numel() * tensor.element_size()
        if bucket:
            yield bucket

    def _send(self, version: int, buckets) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        prepared = self.gateway.PrepareWeightSync(rollout_pb2.PrepareWeightSyncRequest(
            version=version, master_address=self.config.weight_sync_address, master_port=self.port,
            group_name=GROUP_NAME, backend=backend,
        ), timeout=120)  # fmt: skip
        if prepared.group_created or self.group is None:
            if self.group is not None:
                dist.destroy_process_group(self.group)
            init = f"tcp://{self.config.weight_sync_address}:{self.port}"
            self.group = init_custom_process_group(backend, init, prepared.world_size, 0, GROUP_NAME)
        flat = self.config.update_weight_flattened_bucket
        requests: queue.Queue = queue.Queue()
        responses = self.gateway.SyncWeightBuckets(iter(requests.get, None), timeout=3600)
        try:
            for index, bucket in enumerate(buckets):
                specs = [common_pb2.TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                         for n, t in bucket]  # fmt: skip
                requests.put(rollout_pb2.WeightBucket(version=version, bucket_index=index, tensors=specs,
                                                      load_format="flattened_bucket" if flat else ""))  # fmt: skip
                for tensor in [flatten([t for _, t in bucket])] if flat else [t for _, t in bucket]:
                    dist.broadcast(tensor, src=0, group=self.group)
                failed = [e for e in next(responses).engines if not e.success]
                for engine in failed:
                    log.warning("engine %s left the weight sync at bucket %d: %s", engine.url, index, engine.message)
        finally:
            requests.put(None)
        committed = self.gateway.CommitWeightSync(rollout_pb2.CommitWeightSyncRequest(version=version), timeout=120)
        live = sum(e.success for e in committed.engines)
        log.info("weights of version %d sent to %d engine(s)", version, live)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
