"""gRPC face of the trainer (rank 0): status, save a checkpoint now, stop after the current step. Requests are
recorded in the loop's `Control` and carried out by every rank at the next step boundary."""

import asyncio

from services.common.errors import FailedPrecondition
from services.trainer.loop import Control
from slipstream.v1 import trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, control: Control, save_folder: str | None):
        self.control, self.save_folder = control, save_folder

    async def GetStatus(self, request, context):
        c = self.control
        metrics = {k: float(v) for k, v in c.last_metrics.items()}
        return trainer_pb2.TrainerStatus(step=c.step, policy_version=c.policy_version, phase=c.phase,
                                         world_size=c.world_size, last_metrics=metrics)  # fmt: skip

    async def SaveCheckpoint(self, request, context):
        if not (request.path or self.save_folder):
            raise FailedPrecondition("no checkpoint folder: give a path or start the trainer with --save")
        if self.control.phase == "stopped":
            raise FailedPrecondition("the trainer has stopped; its last checkpoint is in --save")
        saved = len(self.control.saved)
        self.control.save_now = request.path
        while len(self.control.saved) == saved and self.control.phase != "stopped":
            await asyncio.sleep(0.1)  # saved at the next step boundary
        if len(self.control.saved) == saved:
            raise FailedPrecondition("the trainer stopped before the checkpoint was written")
        path, step = self.control.saved[-1]
        return trainer_pb2.SaveCheckpointResponse(path=path, step=step)

    async def Stop(self, request, context):
        self.control.save_after_stop = request.save
        self.control.stop = True
        return trainer_pb2.StopResponse()
