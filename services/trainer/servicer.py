"""gRPC face of the trainer (rank 0): status, save a checkpoint now, stop after the current step. Requests are
recorded in the loop's `Control` and carried out by every rank at the next step boundary."""

import asyncio
from pathlib import Path, PurePosixPath

from services.common.errors import FailedPrecondition, InvalidArgument
from services.trainer.loop import Control
from slipstream.v1 import trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, control: Control, save_folder: str | None):
        self.control, self.save_folder = control, save_folder

    async def GetStatus(self, request, context):
        c = self.control
        metrics = {k: float(v) for k, v in c.last_metrics.items()}
        return trainer_pb2.TrainerStatus(
            step=c.step, policy_version=c.policy_version, phase=c.phase, world_size=c.world_size, last_metrics=metrics
        )

    async def SaveCheckpoint(self, request, context):
        folder = checkpoint_folder(request.path, self.save_folder)
        if self.control.phase == "stopped":
            raise FailedPrecondition("the trainer has stopped; its last checkpoint is in --save")
        answered = len(self.control.save_answers)
        self.control.save_now = folder
        while len(self.control.save_answers) == answered and self.control.phase != "stopped":
            await asyncio.sleep(0.1)  # saved at the next step boundary
        if len(self.control.save_answers) == answered:
            raise FailedPrecondition("the trainer stopped before the checkpoint was written")
        answer = self.control.save_answers[-1]
        if isinstance(answer, str):
            raise FailedPrecondition(f"the checkpoint was not written: {answer}; the trainer goes on training")
        path, step = answer
        return trainer_pb2.SaveCheckpointResponse(path=path, step=step)

    async def Stop(self, request, context):
        self.control.save_after_stop = request.save
        self.control.stop = True
        return trainer_pb2.StopResponse()


MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 1024


def checkpoint_folder(path: str, save: str | None) -> str:
    """The folder a SaveCheckpoint request names: under the trainer's --save only ("" is --save itself), so that no
    caller can make the trainer write anywhere else."""
    if not save:
        raise FailedPrecondition(
            "this trainer has no --save folder, and checkpoints are written only under it; start it with --save DIR"
        )
    if not path:
        return ""
    relative = PurePosixPath(path)
    if "\0" in path or relative.is_absolute() or ".." in relative.parts:
        raise InvalidArgument(
            "path",
            f"{path[:200]!r} must name a folder under the trainer's --save, relative to it and without '..' "
            "(e.g. 'before-lr-change'); empty is --save itself",
        )
    if len(path.encode()) > MAX_PATH_BYTES or any(len(p.encode()) > MAX_NAME_BYTES for p in relative.parts):
        limits = f"at most {MAX_PATH_BYTES} bytes, each folder name at most {MAX_NAME_BYTES}"
        raise InvalidArgument("path", f"too long: {limits}")
    root = Path(save).resolve()
    folder = (root / relative).resolve()
    if not folder.is_relative_to(root):  # a symbolic link under --save that leads out of it
        raise InvalidArgument("path", f"{path!r} leads out of the trainer's --save folder through a symbolic link")
    return str(folder)
