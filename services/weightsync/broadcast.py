"""Broadcast: each bucket's specs go to the gateway, which posts them to the engines'
/update_weights_from_distributed (SGLang_API.md §3) while the trainer broadcasts the bucket over the weight group.

The gateway's half: engines that take ordered buckets (`sequence`: the reference engine) are posted the next bucket
at once, while they still receive or load this one; others (SGLang) once every engine answered this one. The
trainer's half: up to --update-weight-buckets-in-flight buckets are sent ahead of the engines' answers, so the next is
converted while they load these."""

import collections

from services.weightsync import halves
from services.weightsync.protocol import EnginesLeft
from slipstream.v1 import rollout_pb2


class Gateway(halves.Gateway):
    kind, name = rollout_pb2.WEIGHT_TRANSPORT_BROADCAST, "broadcast"

    @classmethod
    def of(cls, config, engines: list, adapters=None) -> "Gateway":
        return cls(ordered=all(e.ordered_buckets for e in engines))

    def __init__(self, ordered: bool):
        self.ordered = ordered
        self.sequence = 0  # the next ordered bucket's place in the sync (each engine's session counts from 0)

    def requests(self, engines: list, bucket) -> tuple[str, dict]:
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


class Sender(halves.Sender):
    def __init__(self, *args):
        super().__init__(*args)
        self.in_flight: collections.deque = collections.deque()  # the broadcasts of each bucket not answered yet

    def send(self, index: int, specs: list, tensors) -> None:
        import torch.distributed as dist

        from services.weightsync.group import flatten

        sender, flat = self.sender, self.sender.config.update_weight_flattened_bucket
        self.requests.put(
            rollout_pb2.WeightBucket(
                version=self.version,
                bucket_index=index,
                tensors=specs,
                load_format="flattened_bucket" if flat else "",
                group_name=sender.group_name,
            )
        )
        sender.attempt.in_flight = True
        try:
            works = [
                dist.broadcast(t, src=0, group=sender.group, async_op=True)
                for t in ([flatten(list(tensors))] if flat else tensors)
            ]
        except RuntimeError as e:  # a member is gone: free the others' receives, then hear which one
            sender._drop_group()
            for _ in range(len(self.in_flight) + 1):  # the answers of this bucket and those before
                sender._check(next(self.responses))
            raise EnginesLeft(f"at bucket {index}: {e}") from None
        self.watchdog.progress(f"broadcasting bucket {index}")
        self.in_flight.append(works)
        if len(self.in_flight) >= sender.config.update_weight_buckets_in_flight:
            sender._answered(next(self.responses), self.in_flight.popleft(), self.watchdog)

    def finish(self) -> None:
        while self.in_flight:
            self.sender._answered(next(self.responses), self.in_flight.popleft(), self.watchdog)
