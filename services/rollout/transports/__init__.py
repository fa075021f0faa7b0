"""How a weight sync's buckets reach the engines, one module per transport (a WeightTransport of rollout.proto),
chosen by the gateway at each PrepareWeightSync (`choose`, the pool's LoRA adapters at hand for `lora`): `broadcast`
(each bucket posted to the engines' /update_weights_from_distributed while the trainer broadcasts it), `handles`
(colocated: the bucket's CUDA IPC handles, posted to /update_weights_from_tensor), `streamed` (the sync's whole plan
to the weight receiver beside each engine, the buckets streamed with no call between them), `disk` (a checkpoint
folder the trainer wrote, loaded at the commit) and `lora` (an adapter folder the same way, loaded beside the base
weights). The sync itself (services/rollout/weight_sync.py) holds the group, the sessions, faults and commits, and
asks the transport only what differs."""

from dataclasses import dataclass

from slipstream.v1 import rollout_pb2


@dataclass(frozen=True)
class Bucket:
    """One bucket as a sender sent it (WeightBucket)."""

    index: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    load_format: str = ""
    payloads: tuple[bytes, ...] = ()  # colocated: the tensor handles, one set per trainer GPU
    group_name: str = ""
    num_buckets: int = 0  # streamed: the sender's buckets in this sync
    plan: tuple = ()  # streamed: every bucket's (names, dtypes, shapes) at once, in place of this one's
    commit: bool = False  # a lone sender's whole plan: committed once every engine loaded it (WeightBucket.commit)
    planned: bool = False  # in place of the plan, which came with PrepareWeightSync (WeightBucket.planned)


def specs(tensors) -> tuple[list[str], list[str], list[list[int]]]:
    """A bucket's TensorSpecs as its names, dtypes and shapes."""
    return [t.name for t in tensors], [t.dtype for t in tensors], [list(t.shape) for t in tensors]


class Transport:
    kind = rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED
    uses_group = True  # the members join the senders' weight groups
    ordered = False  # a bucket is posted while those before it still load
    streamed = False  # the trainer sends its whole plan first and awaits no answer between buckets
    pauses = True  # the engines pause for the sync, and take its version as their own at the commit
    labelled = False  # the engines took the sync's version with its last bucket: none is posted at the commit

    @property
    def name(self) -> str:
        return rollout_pb2.WeightTransport.Name(self.kind).removeprefix("WEIGHT_TRANSPORT_").lower()

    def open(self, version: int, groups: list[str]) -> None:
        """A sync of `version` begins, over the weight groups `groups` (one a sender)."""

    def member(self, engine) -> tuple[str, int]:
        """Where `engine`'s group calls go, and its ranks in a weight group."""
        return engine.url, engine.tp_size

    def target(self, engine) -> str:
        """Where `engine`'s bucket calls go."""
        return engine.url

    def requests(self, engines: list, bucket: Bucket) -> tuple[str, dict] | None:
        """The call that delivers `bucket`: (path, {engine url: body, or why that engine cannot take it}); None
        when it is delivered later, with others (its answer is then given at once)."""
        raise NotImplementedError

    def loads(self, engines: list, version: int) -> tuple[str, dict] | None:
        """The call that loads the sync at its commit, in the same form; None when the buckets loaded it."""
        return None

    def committed(self, loaded: list[str], version: int) -> None:
        """The engines at `loaded` serve the sync's version now."""


def choose(asked: int, engines: list, config, adapters=None) -> Transport:
    """The gateway's choice for what the trainer `asked` (a WeightTransport): its own, or, for a weight group, the
    receivers' streamed path where the gateway has them, else the engines' broadcast."""
    from services.rollout.transports.broadcast import Broadcast
    from services.rollout.transports.disk import Disk
    from services.rollout.transports.handles import Handles
    from services.rollout.transports.lora import Lora
    from services.rollout.transports.streamed import Streamed

    if asked == rollout_pb2.WEIGHT_TRANSPORT_LORA:
        return Lora(config.update_weight_disk_dir, adapters)
    if asked == rollout_pb2.WEIGHT_TRANSPORT_HANDLES:
        return Handles()
    if asked == rollout_pb2.WEIGHT_TRANSPORT_DISK:
        return Disk(config.update_weight_disk_dir)
    if config.weight_receiver_port_offset is not None:
        return Streamed(config.weight_receiver_port_offset)
    return Broadcast(ordered=all(e.ordered_buckets for e in engines))
