"""Fault injection, for tests only: `python -m tests.rollout.faulty_engine engine <flags> [--fault F]` is a reference
engine with one fault:
- `receive` (default): its weight receives fail the way a broken NCCL link fails them — at once, without taking part
  in the broadcast (as `Cuda failure 'invalid argument'` in NCCL's p2p transport did between a trainer and an engine
  whose NCCL settings differed);
- `unreachable`: the trainer's weight-group address leads nowhere from it (a wrong `--weight-sync-address`, another
  network, a firewall): its connection to the group's rendezvous is refused until it gives up;
- `one-at-a-time` (no fault, SGLang's way): it offers no ordered weight buckets, and refuses a bucket that comes with
  a `sequence` (SGLang would ignore it, and could receive two buckets in flight out of order)."""

import json
import socket
import sys

import torch.distributed

from services.train.cli import main

NCCL_ERROR = (
    "NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
    "NCCL version 2.28.9; last error: transport/p2p.cc:299 Cuda failure 'invalid argument' (injected)"
)


def _broken_broadcast(*args, **kwargs):
    raise RuntimeError(NCCL_ERROR)


def _refused_port() -> int:
    """A port of this machine where nothing listens (bound, never listening: connections are refused)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    _refused_port.held = held  # kept bound for the process's life
    return held.getsockname()[1]


def _unreachable_store(host, port, *args, **kwargs):
    return _store("127.0.0.1", _refused_port(), *args, **kwargs)


def _one_at_a_time() -> None:
    from services.engine.api import EngineAPI
    from services.engine.responses import control, json_response
    from services.engine.weights import WeightReceiver

    info, update = EngineAPI.server_info, WeightReceiver.update_from_distributed

    async def server_info(self, request):
        body = json.loads((await info(self, request)).body)
        body.pop("ordered_weight_buckets")
        return json_response(body)

    async def update_from_distributed(self, request):
        if "sequence" in await request.json():
            return control(False, "this engine takes one bucket at a time: it was sent a sequence")
        return await update(self, request)

    EngineAPI.server_info, WeightReceiver.update_from_distributed = server_info, update_from_distributed


if __name__ == "__main__":
    args = sys.argv[1:]
    fault = "receive"
    if "--fault" in args:
        at = args.index("--fault")
        fault = args.pop(at + 1)
        args.pop(at)
    if fault == "receive":
        torch.distributed.broadcast = _broken_broadcast  # the engine only broadcasts to receive weights
    elif fault == "one-at-a-time":
        _one_at_a_time()
    else:
        _store, torch.distributed.TCPStore = torch.distributed.TCPStore, _unreachable_store
    sys.exit(main(args))
