"""Writes the trainer's Megatron weights back out as an HF checkpoint directory (config and tokenizer copied from the
source checkpoint, weights as safetensors) that `transformers.AutoModelForCausalLM.from_pretrained` loads."""

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from services.trainer.models import GPTConfig

# Everything in an HF directory except the weights: config, generation config, tokenizer files, chat template.
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "model.safetensors.index.json", "*.bin.index.json")


def copy_hf_metadata(source_dir: str | Path, out_dir: str | Path) -> None:
    """Copies every non-weight file (config.json, tokenizer, chat template, …) from `source_dir` to `out_dir`."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {path for pattern in _WEIGHT_FILES for path in source_dir.glob(pattern)}
    for path in source_dir.iterdir():
        if path.is_file() and path not in weights:
            shutil.copy2(path, out_dir / path.name)


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    part: str | None = None,
) -> tuple[dict[str, str], int]:
    """Saves (HF name, tensor) pairs as `model.safetensors`, or as numbered shards plus an index when they exceed
    `max_shard_bytes`, the layout `from_pretrained` reads. With `part` (one pipeline stage's layers), as shards
    `model-{part}-NNNNN.safetensors` and no index: `write_index` writes one for all parts. Returns the weight map
    (name → file) and the bytes written."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        # Converted tensors can be views of one fused Megatron tensor; safetensors refuses shared storage.
        shards[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard_bytes += size
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    if len(shards) == 1 and part is None:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
        return dict.fromkeys(shards[0], "model.safetensors"), total
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{part}-{i:05d}.safetensors" if part else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    if part is None:
        write_index(out_dir, weight_map, total)
    return weight_map, total


def write_index(out_dir: Path, weight_map: dict[str, str], total: int) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def export_hf_checkpoint(model: "GPTModel", config: "GPTConfig", source_dir: str | Path, out_dir: str | Path) -> None:
    """Writes a Megatron GPTModel (`models.load_gpt_model`'s pair) as an HF directory under `out_dir`.

    A collective over the model-parallel ranks of data-parallel replica 0 (every one calls it): each pipeline stage's
    first rank writes its own layers' shards, and global rank 0 the index of all and the source's other files.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.models import hf_weights_of

    pairs = hf_weights_of(model, config)
    if not dist.is_initialized():
        copy_hf_metadata(source_dir, out_dir)
        write_safetensors(pairs, out_dir)
        return
    if parallel_state.get_tensor_model_parallel_rank() != 0 or parallel_state.get_data_parallel_rank() != 0:
        for _ in pairs:  # still take part in every gather
            pass
        return
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        copy_hf_metadata(source_dir, out_dir)
        write_safetensors(pairs, out_dir)
        return
    stage, group = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_group()
    written = write_safetensors(pairs, out_dir, part=f"pp{stage:03d}")
    parts = [None] * stages if stage == 0 else None
    dist.gather_object(written, parts, dst=dist.get_global_rank(group, 0), group=group)
    if stage == 0:
        copy_hf_metadata(source_dir, out_dir)
        write_index(
            Path(out_dir),
            {k: v for weight_map, _ in parts for k, v in weight_map.items()},
            sum(total for _, total in parts),
        )
