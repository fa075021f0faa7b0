"""Groups scored at the same moment share one Score call to a real reward service, each gets its own results, and a
batch the service refuses fails only the group whose item it refused."""

import asyncio

import grpc
import pytest

from services.common.clients import open_aio_channel
from services.reward.config import RewardConfig
from services.reward.server import build
from services.rollout.scoring import ScoreBatcher
from slipstream.v1 import reward_pb2, reward_pb2_grpc


class CountingStub:
    """A real RewardService stub that counts its Score calls."""

    def __init__(self, stub):
        self.stub, self.calls = stub, 0

    async def Score(self, request, timeout):
        self.calls += 1
        return await self.stub.Score(request, timeout=timeout)


def group(index: int, correct: bool, rm_type: str = "") -> list[reward_pb2.RewardItem]:
    answer = f"answer {index}"
    return [reward_pb2.RewardItem(item_id=f"g{index}/0", response=answer.encode(), rm_type=rm_type,
                                  label=answer if correct else "something else")]  # fmt: skip


@pytest.fixture
async def reward(grpc_service):
    address = grpc_service(build, RewardConfig(num_workers=2)).address
    async with open_aio_channel(address) as channel:
        yield CountingStub(reward_pb2_grpc.RewardServiceStub(channel))


async def test_groups_ready_together_share_one_call_and_get_their_own_results(reward):
    batcher = ScoreBatcher(reward)
    groups = [group(i, correct=i % 3 == 0) for i in range(12)]
    results = await asyncio.gather(*(batcher.score(items, "exact") for items in groups))
    assert reward.calls == 1
    assert [[r.item_id for r in found] for found in results] == [[f"g{i}/0"] for i in range(12)]
    assert [found[0].reward for found in results] == [float(i % 3 == 0) for i in range(12)]
    assert (await batcher.score(group(99, correct=True), "exact"))[0].reward == 1.0  # a lone group goes at once
    assert reward.calls == 2


async def test_a_refused_item_fails_only_its_own_group(reward):
    batcher = ScoreBatcher(reward)
    groups = [group(i, correct=True, rm_type="no_such_reward" if i == 2 else "") for i in range(5)]
    results = await asyncio.gather(*(batcher.score(items, "exact") for items in groups), return_exceptions=True)
    assert isinstance(results[2], grpc.aio.AioRpcError)
    assert results[2].code() == grpc.StatusCode.INVALID_ARGUMENT and "no_such_reward" in results[2].details()
    assert [found[0].reward for i, found in enumerate(results) if i != 2] == [1.0] * 4
