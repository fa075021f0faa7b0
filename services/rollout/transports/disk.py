"""--update-weight-transport disk: the trainer writes each sync as an HF checkpoint folder under its
--update-weight-disk-dir; at the commit every engine loads it through /update_weights_from_disk, from this gateway's
--update-weight-disk-dir (the same folder as the engines see it), the trainer naming only the version. No weight
group; the buckets' specs arrive as the trainer writes them and are answered at once."""

from pathlib import PurePosixPath

from services.common import weight_folders
from services.common.errors import FailedPrecondition
from services.rollout.transports import Bucket, Transport
from slipstream.v1 import rollout_pb2


class Disk(Transport):
    kind = rollout_pb2.WEIGHT_TRANSPORT_DISK
    uses_group = False

    def __init__(self, folder: str | None):
        if not folder:
            raise FailedPrecondition(
                "the trainer sends weights through disk (--update-weight-transport disk): start the gateway with "
                "--update-weight-disk-dir, the trainer's folder as the engines see it"
            )
        self.folder = PurePosixPath(folder)

    def requests(self, engines: list, bucket: Bucket) -> None:
        return None

    def loads(self, engines: list, version: int) -> tuple[str, dict]:
        body = {
            "model_path": str(self.folder / weight_folders.published(version)),
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": False,
        }
        return "/update_weights_from_disk", {e.url: body for e in engines}
