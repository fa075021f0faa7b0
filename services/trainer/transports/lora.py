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
        config = self.sender.config
        settings = lora.adapter_config(lora.settings_of(config), config.hf_checkpoint, tensors)
        (self.folder / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
