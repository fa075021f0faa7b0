"""Streamed through the weight receiver beside each engine (services/receiver): the receivers are the weight group's
members (one rank each); a sender's whole plan (every bucket's names, dtypes and shapes, in one message, or a message
a bucket) goes to every receiver in one /receive_weights call once complete, and the receivers answer once their
engines loaded every bucket, fed through SGLang's /update_weights_from_ipc. Buckets sent a message each are answered
at once but for the last. The last sender's whole plan carries the sync's version, which the engines take with a
load that succeeded: the commit has no version to post."""

from urllib.parse import urlsplit, urlunsplit

from services.rollout.transports import Bucket, Transport
from slipstream.v1 import rollout_pb2


class Streamed(Transport):
    kind = rollout_pb2.WEIGHT_TRANSPORT_STREAMED
    streamed = True

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

    def requests(self, engines: list, bucket: Bucket) -> tuple[str, dict] | None:
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
