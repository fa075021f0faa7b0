"""Assembles the trainer service from its config."""

from services.common.server import Service, Servicer
from services.trainer.config import TrainerConfig
from services.trainer.servicer import TrainerServicer


async def build(config: TrainerConfig) -> Service:
    return Service("trainer", config, [Servicer.of(TrainerServicer())])
