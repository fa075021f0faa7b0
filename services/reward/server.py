"""Assembles the reward service from its config."""

from services.common.server import Service, Servicer
from services.reward.config import RewardConfig
from services.reward.servicer import RewardServicer


async def build(config: RewardConfig) -> Service:
    return Service("reward", config, [Servicer.of(RewardServicer())])
