"""Assembles the reward service from its config."""

from services.reward.config import RewardConfig
from services.reward.servicer import RewardServicer
from services.common.server import Service, Servicer


async def build(config: RewardConfig) -> Service:
    return Service("reward", config, [Servicer.of(RewardServicer())])
