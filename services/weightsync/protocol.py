"""The weight-sync protocol in one place (docs/rollout.md, "The protocol in one place"): the messages a sender's
buckets become at the gateway, the errors a sync ends with, both sides' phase tables and the table of transports.

A sync is one version of the weights going from the trainer's senders (one per pipeline stage) through the gateway
to every engine: Prepare (the gateway pauses the engines and, for a weight group, has them join it), a stream of
buckets (each delivered to every engine at once), then Commit (the engines serve the version, generation resumes).
How the buckets travel is the transport's: one module each in this package, its trainer's and its gateway's halves
side by side, picked by `factory`."""

import enum
from dataclasses import dataclass


class EnginesLeft(Exception):
    """An engine left the weight group mid-sync: the group is gone, and the sync starts over without it."""


class GatewayLeft(Exception):
    """The gateway did not answer mid-sync (with a fleet of gateways: the coordinator died, and another takes its
    lease): the sync starts over, through whichever gateway answers; when none does, it fails as other errors do."""


class Unreachable(Exception):
    """No engine joined the weight group: they cannot reach the trainer at its address, which no retry fixes."""


class WeightSyncFailed(Exception):
    """No engine could take the weights, attempt after attempt: the run cannot go on with a policy it cannot serve."""


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


class SenderPhase(enum.Enum):
    """The trainer's: where one attempt at sending a version is (docs/rollout.md, 'The protocol in one place')."""

    PREPARING = "preparing"  # Prepare asked; the weight group joined where the gateway built a new one
    SENDING = "sending"  # buckets going out: broadcasts may be in flight, colocated peers wait in a hand-over
    SENT = "sent"  # the engines loaded every bucket: nothing in flight, no peer waiting
    COMMITTING = "committing"  # the coordinator asked the gateway to commit
    COMMITTED = "committed"  # every sender's outcome is success: the engines serve the version
    FAILED = "failed"  # any failure, here or at another sender: the next attempt starts from a new one


_S = SenderPhase
SENDER_MOVES = {
    _S.PREPARING: {_S.SENDING, _S.FAILED},
    _S.SENDING: {_S.SENT, _S.FAILED},
    _S.SENT: {_S.COMMITTING, _S.COMMITTED, _S.FAILED},  # a sender other than the coordinator commits none
    _S.COMMITTING: {_S.COMMITTED, _S.FAILED},
    _S.COMMITTED: set(),
    _S.FAILED: set(),
}


class GatewayPhase(enum.Enum):
    """The gateway's: where a sync attempt is (docs/rollout.md, "The protocol in one place")."""

    PREPARED = "prepared"  # the engines paused and joining; none holds any of the sync yet
    LOADING = "loading"  # an engine loaded part of the sync: its weights are of no version until a sync completes
    COMMITTING = "committing"  # the trainer's word is in: no deadline but its calls'
    COMMITTED = "committed"
    ABORTED = "aborted"


BACK = None  # a failed commit returns to the phase before it
_P = GatewayPhase
GATEWAY_MOVES = {  # phase -> {event: the next phase}; any other event in that phase is a bug, raised as one
    _P.PREPARED: {"prepare": _P.PREPARED, "loaded": _P.LOADING, "commit": _P.COMMITTING, "abort": _P.ABORTED},
    _P.LOADING: {"prepare": _P.LOADING, "loaded": _P.LOADING, "commit": _P.COMMITTING, "abort": _P.ABORTED},
    _P.COMMITTING: {"loaded": _P.COMMITTING, "committed": _P.COMMITTED, "failed": BACK, "abort": _P.ABORTED},
}
