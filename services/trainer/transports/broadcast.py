"""Each bucket's specs to the gateway (which posts them to the engines), then its broadcast; up to
--update-weight-buckets-in-flight buckets are sent ahead of the engines' answers, so the next is converted while
they load these."""

import collections

import torch.distributed as dist

from services.common.weight_group import flatten
from services.trainer.transports import EnginesLeft, Transport
from slipstream.v1 import rollout_pb2


class Broadcast(Transport):
    def __init__(self, *args):
        super().__init__(*args)
        self.in_flight: collections.deque = collections.deque()  # the broadcasts of each bucket not answered yet

    def send(self, index: int, specs: list, tensors) -> None:
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
