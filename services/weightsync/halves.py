"""The two halves of a transport, as each transport module subclasses them: the gateway's (`Gateway`: the calls that
deliver a sync's buckets to the engines) and the trainer's (`Sender`: how a sender sends them once the gateway
prepared the sync). The syncs themselves hold the groups, attempts, faults and commits and ask the halves only what
differs: services/rollout/weight_sync.py on the gateway, services/trainer/weight_sync.py on the trainer.

A module holding both is imported by the gateway too, which runs without torch: a sender's half imports the torch
side (`tensors`, `group`, `delta`) where it runs."""

import queue

from slipstream.v1 import rollout_pb2


class Gateway:
    kind = rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED
    name = ""  # the transport's name (factory.TRANSPORTS)
    uses_group = True  # the members join the senders' weight groups
    ordered = False  # a bucket is posted while those before it still load
    streamed = False  # the trainer sends its whole plan first and awaits no answer between buckets
    pauses = True  # the engines pause for the sync, and take its version as their own at the commit
    labelled = False  # the engines took the sync's version with its last bucket: none is posted at the commit
    takes_delta = False  # --update-weight-mode delta: the senders may send only the changes (the receivers apply them)

    @classmethod
    def of(cls, config, engines: list, adapters=None) -> "Gateway":
        """The half for a sync of `engines`, from the gateway's settings (`config`) and the pool's LoRA adapters; a
        setting it needs and lacks is refused (FailedPrecondition), before any engine pauses."""
        return cls()

    def open(self, version: int, groups: list[str]) -> None:
        """A sync of `version` begins, over the weight groups `groups` (one a sender)."""

    def member(self, engine) -> tuple[str, int]:
        """Where `engine`'s group calls go, and its ranks in a weight group."""
        return engine.url, engine.tp_size

    def target(self, engine) -> str:
        """Where `engine`'s bucket calls go."""
        return engine.url

    def requests(self, engines: list, bucket) -> tuple[str, dict] | None:
        """The call that delivers `bucket` (protocol.Bucket): (path, {engine url: body, or why that engine cannot take
        it}); None when it is delivered later, with others (its answer is then given at once)."""
        raise NotImplementedError

    def loads(self, engines: list, version: int) -> tuple[str, dict] | None:
        """The call that loads the sync at its commit, in the same form; None when the buckets loaded it."""
        return None

    def committed(self, loaded: list[str], version: int) -> None:
        """The engines at `loaded` serve the sync's version now."""


class Sender:
    name = ""  # the transport's (factory.sender_half sets it)
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
        """Returns once the engines loaded every bucket sent, raising protocol.EnginesLeft when an engine failed."""

    def publish(self) -> None:
        """The coordinator's, once every sender's buckets went: what must happen before the commit."""

    def committed(self) -> None:
        """The coordinator's, once the engines serve the sync."""
