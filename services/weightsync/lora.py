"""LoRA (--lora-rank): each sync sends only the adapters, as a peft adapter folder under --update-weight-disk-dir
(`weight_v000042/`: adapter_config.json, adapter_model.safetensors) that the engines load at the commit through
SGLang's /load_lora_adapter under a name of the run and version (services/rollout/adapters.py); generation then asks
for it by that name. The base weights never travel: the engines keep --hf-checkpoint's.

The trainer's half: each pipeline stage's sender writes its adapters as a shard, and the coordinator joins them into
the one file peft and SGLang read. The gateway's half: the engines keep generating meanwhile (an adapter load touches
no other weights, and the engines may serve other runs' adapters as well), so nothing is paused and their own version
label is left alone."""

import json

from services.common.errors import FailedPrecondition
from services.weightsync import disk, folders
from slipstream.v1 import rollout_pb2


class Gateway(disk.Gateway):
    kind, name = rollout_pb2.WEIGHT_TRANSPORT_LORA, "lora"
    pauses = False

    @classmethod
    def of(cls, config, engines: list, adapters=None) -> "Gateway":
        return cls(config.update_weight_disk_dir, adapters)

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
        return str(self.folder / folders.published(version))

    def loads(self, engines: list, version: int) -> tuple[str, dict]:
        body = {"lora_name": self.adapters.name(version), "lora_path": self.folder_of(version)}
        return "/load_lora_adapter", {e.url: body for e in engines}

    def committed(self, loaded: list[str], version: int) -> None:
        self.adapters.committed(version, self.folder_of(version), loaded)


class Sender(disk.Sender):
    shard = "adapter"
    keeps_latest = True  # an engine admitted later loads it before its first request

    def assemble(self, weight_map: dict[str, str], total: int) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        shards = sorted(set(weight_map.values()))
        target = self.folder / "adapter_model.safetensors"
        if len(shards) == 1:  # one sender, one bucket: the shard is the file
            (self.folder / shards[0]).rename(target)
            with safe_open(target, framework="pt") as f:
                tensors = dict.fromkeys(f.keys())
        else:
            tensors = {}
            for name in shards:
                tensors.update(load_file(self.folder / name))
                (self.folder / name).unlink()
            save_file(tensors, target, metadata={"format": "pt"})
        settings = self.sender.adapter_config(tensors)
        (self.folder / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
