"""Assembles the rollout service from its config."""

from services.rollout.config import RolloutConfig
from services.rollout.servicer import RolloutServicer
from services.common.server import Service, Servicer


async def build(config: RolloutConfig) -> Service:
    return Service("rollout", config, [Servicer.of(RolloutServicer())])
