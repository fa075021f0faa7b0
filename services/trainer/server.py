"""Assembles the trainer: on rank 0 the control surface (`TrainerService`) around the training loop, which runs in
a thread of its own; the service ends when the loop does (the run is over, or Stop was asked)."""

import asyncio
import threading

from services.common.errors import StartupError
from services.common.server import Service, Servicer
from services.trainer.config import TrainerConfig
from services.trainer.loop import Control
from services.trainer.servicer import TrainerServicer


async def build(config: TrainerConfig) -> Service:
    control = Control()
    trainer = await asyncio.to_thread(_build_trainer, config, control)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            trainer.run()
            loop.call_soon_threadsafe(finished.set_result, None)
        except BaseException as e:  # reported by the service as its failure
            loop.call_soon_threadsafe(finished.set_exception, e)

    async def ready() -> None:
        threading.Thread(target=run, name="train", daemon=True).start()

    async def stop() -> None:
        control.stop = True

    servicer = Servicer.of(TrainerServicer(control, config.save))
    return Service("trainer", config, [servicer], ready=ready, on_stop=[stop], finished=finished)


def _build_trainer(config: TrainerConfig, control: Control):
    if not config.hf_checkpoint:
        raise StartupError("the trainer needs the model: pass --hf-checkpoint")
    from services.trainer.loop import Trainer

    try:
        return Trainer(config, control)
    except (ValueError, FileNotFoundError) as e:
        raise StartupError(str(e)) from None
