"""Colocated: each bucket is its tensors' handles (CUDA IPC; on the CPU, shared-memory files), one set per trainer
GPU, posted to the engines' /update_weights_from_tensor; no weight group. Every trainer rank waits for the gateway's
answer: the tensors must live until the engines copied them."""

import base64

from services.weightsync import halves
from slipstream.v1 import rollout_pb2


class Gateway(halves.Gateway):
    kind, name = rollout_pb2.WEIGHT_TRANSPORT_HANDLES, "handles"
    uses_group = False

    def requests(self, engines: list, bucket) -> tuple[str, dict]:
        encoded = [base64.b64encode(p).decode() for p in bucket.payloads]
        return "/update_weights_from_tensor", {e.url: _handed_over(encoded, e) for e in engines}


def _handed_over(payloads: list[str], engine) -> dict | str:
    """A colocated bucket for `engine`: the handles of the trainer rank on each of its TP ranks' GPUs (a trainer on
    one GPU hands every engine the same); or why it has none."""
    if len(payloads) > 1 and max(engine.gpus) >= len(payloads):
        return (
            f"/update_weights_from_tensor: the engine runs on GPUs {list(engine.gpus)} but the trainer holds GPUs "
            f"0-{len(payloads) - 1}: colocated engines run on the trainer's GPUs (--base-gpu-id)"
        )
    chosen = payloads if len(payloads) == 1 else [payloads[gpu] for gpu in engine.gpus]
    return {"serialized_named_tensors": chosen, "flush_cache": False}


class Sender(halves.Sender):
    def send(self, index: int, specs: list, tensors) -> None:
        self.sender._hand_over(self.version, index, specs, tensors, self.requests, self.responses)
