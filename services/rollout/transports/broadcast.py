"""Buckets posted to the engines' /update_weights_from_distributed (SGLang_API.md §3) while the trainer broadcasts
them. Engines that take ordered buckets (`sequence`: the reference engine) are posted the next bucket at once, while
they still receive or load this one; others (SGLang) once every engine answered this one."""

from services.rollout.transports import Bucket, Transport
from slipstream.v1 import rollout_pb2


class Broadcast(Transport):
    kind = rollout_pb2.WEIGHT_TRANSPORT_BROADCAST

    def __init__(self, ordered: bool):
        self.ordered = ordered
        self.sequence = 0  # the next ordered bucket's place in the sync (each engine's session counts from 0)

    def requests(self, engines: list, bucket: Bucket) -> tuple[str, dict]:
        body = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "group_name": bucket.group_name,
            "load_format": bucket.load_format or None,
            "flush_cache": False,
        }
        if self.ordered:
            body["sequence"], self.sequence = self.sequence, self.sequence + 1
        return "/update_weights_from_distributed", {e.url: body for e in engines}
