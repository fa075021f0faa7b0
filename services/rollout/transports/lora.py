"""LoRA (the trainer's --lora-rank): each sync is a peft adapter folder the trainer wrote under its
--update-weight-disk-dir; at the commit every engine loads it through /load_lora_adapter, from this gateway's
--update-weight-disk-dir (the same folder as the engines see it), under the run's name for the version
(services/rollout/adapters.py). The engines keep generating meanwhile: an adapter load touches no other weights, and
the engines may serve other runs' adapters as well, so nothing is paused and their own version label is left alone."""

from services.common import weight_folders
from services.common.errors import FailedPrecondition
from services.rollout.transports.disk import Disk
from slipstream.v1 import rollout_pb2


class Lora(Disk):
    kind = rollout_pb2.WEIGHT_TRANSPORT_LORA
    pauses = False

    def __init__(self, folder: str | None, adapters):
        if not folder:
            raise FailedPrecondition(
                "the trainer sends LoRA adapters (--lora-rank) as folders the engines load: start the gateway with "
                "--update-weight-disk-dir, the trainer's folder as the engines see it"
            )
        if adapters is None:
            raise FailedPrecondition(
                "the trainer sends LoRA adapters (--lora-rank): start the gateway with --lora-rank as well, and "
                "engines that serve adapters (SGLang's --enable-lora)"
            )
        super().__init__(folder)
        self.adapters = adapters

    def folder_of(self, version: int) -> str:
        return str(self.folder / weight_folders.published(version))

    def loads(self, engines: list, version: int) -> tuple[str, dict]:
        body = {"lora_name": self.adapters.name(version), "lora_path": self.folder_of(version)}
        return "/load_lora_adapter", {e.url: body for e in engines}

    def committed(self, loaded: list[str], version: int) -> None:
        self.adapters.committed(version, self.folder_of(version), loaded)
