"""Fault injection, for tests only: `python -m tests.rollout.faulty_engine engine <flags>` is a reference
engine whose weight receives fail the way a broken NCCL link fails them — at once, without taking part in the
broadcast (as `Cuda failure 'invalid argument'` in NCCL's p2p transport did between a trainer and an engine whose
NCCL settings differed)."""

import sys

import torch.distributed

from slipstream.cli import main

NCCL_ERROR = (
    "NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
    "NCCL version 2.28.9; last error: transport/p2p.cc:299 Cuda failure 'invalid argument' (injected)"
)


def _broken_broadcast(*args, **kwargs):
    raise RuntimeError(NCCL_ERROR)


if __name__ == "__main__":
    torch.distributed.broadcast = _broken_broadcast  # the engine only broadcasts to receive weights
    sys.exit(main(sys.argv[1:]))
