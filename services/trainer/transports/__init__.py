"""How the trainer's sender sends a sync's buckets once the gateway prepared it, one module per transport (a
WeightTransport of rollout.proto): the trainer asks for one (`asked`), the gateway decides, and `choose` takes the
sender's half of the gateway's choice: `broadcast` (each bucket's specs to the gateway, then its
broadcast, a few in flight), `handles` (colocated: the bucket's tensor handles, every GPU's), `streamed` (the whole
plan first, then every bucket's bytes, with no answer awaited between them) and `disk` (an HF checkpoint the engines
load at the commit). The sync itself (services/trainer/weight_sync.py) holds the groups, attempts, the watchdog and
commits; a transport sends buckets (`send`), waits for the engines (`finish`), raising EnginesLeft when an engine
failed, and (the coordinator's) makes the sync loadable before the commit (`publish`)."""

import queue

import torch

from slipstream.v1 import rollout_pb2


class EnginesLeft(Exception):
    """An engine left the weight group mid-sync: the group is gone, and the sync starts over without it."""


class GatewayLeft(Exception):
    """The gateway did not answer mid-sync (with a fleet of gateways: the coordinator died, and another takes its
    lease): the sync starts over, through whichever gateway answers; when none does, it fails as other errors do."""


class Unreachable(Exception):
    """No engine joined the weight group: they cannot reach the trainer at its address, which no retry fixes."""


class WeightSyncFailed(Exception):
    """No engine could take the weights, attempt after attempt: the run cannot go on with a policy it cannot serve."""


def asked(config) -> int:
    """The WeightTransport a sync asks the gateway for: its own for LoRA, disk and colocation; unspecified for a
    weight group, where the gateway picks broadcast or streamed."""
    if config.lora_rank:
        return rollout_pb2.WEIGHT_TRANSPORT_LORA
    if config.update_weight_transport == "disk":
        return rollout_pb2.WEIGHT_TRANSPORT_DISK
    if config.colocate:
        return rollout_pb2.WEIGHT_TRANSPORT_HANDLES
    return rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED


def group_backend() -> str:
    """A weight group's collective backend."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class Transport:
    # Whether `send` takes the weights as views in any shape, each view's elements in its tensor's order (the
    # parameters' own views, models.WeightViews), rather than tensors of the specs' shapes.
    takes_views = False
    # The commit's results where the gateway committed with the last answer (WeightBucket.commit), else None.
    commit_results: list | None = None

    def __init__(self, sender, prepared, version: int, requests: queue.Queue, responses, watchdog):
        self.sender, self.prepared, self.version, self.requests = sender, prepared, version, requests
        self.responses, self.watchdog = responses, watchdog

    def send(self, index: int, specs: list, tensors) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Returns once the engines loaded every bucket sent."""

    def publish(self) -> None:
        """The coordinator's, once every sender's buckets went: what must happen before the commit."""

    def committed(self) -> None:
        """The coordinator's, once the engines serve the sync."""


def choose(sender, prepared, version: int, requests: queue.Queue, responses, watchdog) -> Transport:
    """The sender's half of the transport the gateway chose (PrepareWeightSyncResponse.transport)."""
    from services.trainer.transports.broadcast import Broadcast
    from services.trainer.transports.disk import Disk
    from services.trainer.transports.handles import Handles
    from services.trainer.transports.lora import Lora
    from services.trainer.transports.streamed import Streamed

    halves = {
        rollout_pb2.WEIGHT_TRANSPORT_BROADCAST: Broadcast,
        rollout_pb2.WEIGHT_TRANSPORT_STREAMED: Streamed,
        rollout_pb2.WEIGHT_TRANSPORT_HANDLES: Handles,
        rollout_pb2.WEIGHT_TRANSPORT_DISK: Disk,
        rollout_pb2.WEIGHT_TRANSPORT_LORA: Lora,
    }
    if sender.config.update_weight_mode == "delta" and prepared.transport != rollout_pb2.WEIGHT_TRANSPORT_STREAMED:
        raise Unreachable(
            "--update-weight-mode delta needs a weight receiver beside each engine: start the gateway "
            "with --weight-receiver-port-offset (docs/rollout.md, 'Streamed weight sync')"
        )
    if prepared.transport not in halves:
        raise Unreachable(f"the gateway chose weight transport {prepared.transport}, which this trainer does not know")
    half = halves[prepared.transport]
    sender.kept = {half: sender.kept.get(half)}  # another half's leftovers go
    return half(sender, prepared, version, requests, responses, watchdog)
