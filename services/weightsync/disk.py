"""Disk (--update-weight-transport disk): each sync is an HF checkpoint folder under --update-weight-disk-dir, which
the engines load at the commit through /update_weights_from_disk; no weight group.

The trainer's half: each sender writes its buckets as shards named for its stage (`model-<group>-NNNNN.safetensors`)
and its part of the index into the sync's staging folder; the coordinator, once every sender wrote, merges the index,
copies the checkpoint's other files (config, tokenizer) and renames the folder to the version's name, so no engine
ever loads a half-written one. Each bucket's specs still go to the gateway as it is written: their answers keep the
sync alive while a large checkpoint is written. The gateway's half answers them at once and, at the commit, has every
engine load the folder from the gateway's --update-weight-disk-dir (the same folder as the engines see it), the
trainer naming only the version."""

import json
import logging
import shutil
from pathlib import Path, PurePosixPath

from services.common.errors import FailedPrecondition
from services.weightsync import folders, halves
from slipstream.v1 import rollout_pb2

log = logging.getLogger(__name__)


class Gateway(halves.Gateway):
    kind, name = rollout_pb2.WEIGHT_TRANSPORT_DISK, "disk"
    uses_group = False

    @classmethod
    def of(cls, config, engines: list, adapters=None) -> "Gateway":
        return cls(config.update_weight_disk_dir)

    def __init__(self, folder: str | None):
        if not folder:
            raise FailedPrecondition(
                "the trainer sends weights through disk (--update-weight-transport disk): start the gateway with "
                "--update-weight-disk-dir, the trainer's folder as the engines see it"
            )
        self.folder = PurePosixPath(folder)

    def requests(self, engines: list, bucket) -> None:
        return None

    def loads(self, engines: list, version: int) -> tuple[str, dict]:
        body = {
            "model_path": str(self.folder / folders.published(version)),
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": False,
        }
        return "/update_weights_from_disk", {e.url: body for e in engines}


class Sender(halves.Sender):
    shard = "model"  # the shards' names: model-<group>-NNNNN.safetensors
    keeps_latest = False  # the committed folder stays for engines admitted later

    def __init__(self, *args):
        super().__init__(*args)
        self.root = Path(self.sender.config.update_weight_disk_dir)
        self.folder = self.root / folders.staging(self.version)
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def send(self, index: int, specs: list, tensors) -> None:
        from safetensors.torch import save_file

        name = f"{self.shard}-{self.sender.group_name}-{index:05d}.safetensors"
        bucket = _on_host([s.name for s in specs], tensors)
        _writing(self.folder, lambda: save_file(bucket, self.folder / name, metadata={"format": "pt"}))
        self.weight_map.update(dict.fromkeys(bucket, name))
        self.total += sum(t.numel() * t.element_size() for t in bucket.values())
        self.requests.put(
            rollout_pb2.WeightBucket(
                version=self.version, bucket_index=index, tensors=specs, group_name=self.sender.group_name
            )
        )
        self.sender._check(next(self.responses))

    def finish(self) -> None:
        part = {"total_size": self.total, "weight_map": self.weight_map}
        _writing(
            self.folder, lambda: (self.folder / f"index-{self.sender.group_name}.json").write_text(json.dumps(part))
        )

    def publish(self) -> None:
        """One index for every sender's shards (a shard of an earlier attempt or run that no index names is not
        loaded), the checkpoint's other files, and the folder renamed into place."""

        def publish() -> None:
            weight_map, total = {}, 0
            for name in self.sender.group_names():
                path = self.folder / f"index-{name}.json"
                part = json.loads(path.read_text())
                weight_map.update(part["weight_map"])
                total += part["total_size"]
                path.unlink()
            self.assemble(weight_map, total)
            target = self.root / folders.published(self.version)
            shutil.rmtree(target, ignore_errors=True)  # of an attempt whose commit failed, or of an earlier run
            self.folder.rename(target)

        _writing(self.folder, publish)

    def assemble(self, weight_map: dict[str, str], total: int) -> None:
        """The folder made loadable from every sender's shards: an HF checkpoint's index and other files."""
        self.sender.hf_files(self.folder, weight_map, total)

    def committed(self) -> None:
        """The engines loaded it: unless --update-weight-disk-keep-files this sync's folder goes, with those of
        earlier versions (an engine that joins later gets a sync of its own); staging folders of syncs that failed
        go in any case."""
        keep = self.sender.config.update_weight_disk_keep_files
        for path in self.root.iterdir():
            version, published = folders.version_of(path.name), folders.is_published(path.name)
            if version is None or version > self.version or (published and keep):
                continue
            if not (published and version == self.version and self.keeps_latest):
                shutil.rmtree(path, ignore_errors=True)


def _on_host(names: list[str], tensors) -> dict:
    """Copies of the tensors in host memory, one copy a dtype, not one a tensor (each a device round trip: an
    adapter's sync has 504 small tensors). Copies: converted tensors can be views of one fused tensor, or one tensor
    under several names (a fused layer's adapter A), which safetensors refuses to write."""
    import torch

    tensors, by_dtype = list(tensors), {}
    for k, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(k)
    host: list = [None] * len(tensors)
    for ks in by_dtype.values():
        flat = torch.cat([tensors[k].detach().reshape(-1) for k in ks]).to("cpu")
        for k, part in zip(ks, flat.split([tensors[k].numel() for k in ks]), strict=True):
            host[k] = part.view(tensors[k].shape)
    return dict(zip(names, host, strict=True))


def _writing(folder: Path, write) -> None:
    """`write`, with an error that names the folder: a full or unwritable disk fails the sync (and is retried)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write()
    except OSError as e:
        raise RuntimeError(f"--update-weight-disk-dir: cannot write the weights into {folder}: {e}") from None
