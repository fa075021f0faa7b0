"""Assembles the rollout service from its config."""

from services.common.server import Service, Servicer
from services.rollout.config import RolloutConfig
from services.rollout.servicer import RolloutServicer


async def build(config: RolloutConfig) -> Service:
    return Service("rollout", config, [Servicer.of(RolloutServicer())])
