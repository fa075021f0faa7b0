"""LoRA (--lora-rank): each sync sends only the adapters, as a peft adapter folder under --update-weight-disk-dir
(`weight_v000042/`: adapter_config.json, adapter_model.safetensors) that the engines load at the commit through
SGLang's /load_lora_adapter under a name of the run and version; generation then asks for it by that name. Each
pipeline stage's sender writes its adapters as a shard, and the coordinator joins them into the one file peft and
SGLang read. The base weights never travel: the engines keep --hf-checkpoint's."""

import json

from services.trainer import lora
from services.trainer.transports.disk import Disk


class Lora(Disk):
    shard = "adapter"
    keeps_latest = True  # an engine admitted later loads it before its first request

    def assemble(self, weight_map: dict[str, str], total: int) -> None:
        from safetensors.torch import load_file, save_file

        tensors = {}
        for name in sorted(set(weight_map.values())):
            tensors.update(load_file(self.folder / name))
            (self.folder / name).unlink()
        save_file(tensors, self.folder / "adapter_model.safetensors", metadata={"format": "pt"})
        config = self.sender.config
        settings = lora.adapter_config(lora.settings_of(config), config.hf_checkpoint, tensors)
        (self.folder / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
