"""Reward fixtures: a real reward service in-process on port 0, with any config, and plugin files."""

import grpc
import pytest

from services.reward.config import RewardConfig
from services.reward.server import build
from slipstream.v1 import reward_pb2, reward_pb2_grpc

PLUGIN = """
import asyncio, os, time

def slow_or_broken(args, sample):
    if sample.response == "hang":
        while True:
            time.sleep(1)
    if sample.response == "raise":
        raise ValueError("the judge refused")
    if sample.response == "crash":
        os._exit(3)
    if sample.response == "hog":  # 2 GiB, touched
        hog = bytearray(2 << 30)
        return float(len(hog))
    if sample.response == "leak":  # 64 MiB at a time, each touched, until the limit stops it
        leaked = []
        while True:
            leaked.append(bytearray(64 << 20))
    if sample.response == "pid":
        return float(os.getpid())
    return {"score": float(len(sample.response)), "label_len": len(sample.label), "verdict": "ok"}

async def async_judge(args, sample):
    await asyncio.sleep(0.01)
    return 1.0 if sample.label in sample.response else 0.0

def rank_group(args, samples):
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    return [float(order.index(i)) for i in range(len(samples))]
"""


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "judges.py"
    path.write_text(PLUGIN)
    return path


@pytest.fixture
def reward_service(grpc_service, channel_to):
    """`stub = reward_service(**config)`: a RewardService stub on a fresh in-process service."""

    def start(**settings) -> reward_pb2_grpc.RewardServiceStub:
        config = RewardConfig(**{"num_workers": 2, **settings})
        return reward_pb2_grpc.RewardServiceStub(channel_to(grpc_service(build, config).address))

    return start


def items(*triples, **fields) -> list[reward_pb2.RewardItem]:
    """RewardItems from (response, label) pairs or (response, label, rm_type) triples."""
    out = []
    for i, (response, label, *rm_type) in enumerate(triples):
        raw = response if isinstance(response, bytes) else response.encode()
        out.append(
            reward_pb2.RewardItem(item_id=f"i{i}", response=raw, label=label, rm_type=(rm_type or [""])[0], **fields)
        )
    return out


def score(stub, *triples, rm_type="", timeout=0.0, group=False) -> list[reward_pb2.RewardResult]:
    call = stub.ScoreGroup if group else stub.Score
    request_type = reward_pb2.ScoreGroupRequest if group else reward_pb2.ScoreRequest
    request = request_type(items=items(*triples), rm_type=rm_type, timeout_seconds=timeout)
    return list(call(request, timeout=60).results)


def error_code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()
