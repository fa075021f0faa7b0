"""SGLang's `/update_weights_from_disk`: the model's weights reloaded in place from an HF checkpoint folder (the
safetensors its index names, or every one without an index), then `weight_version` set. The reference engine loads
only from under its --weight-disk-dir (SGLang loads any path it is given): a request names no other folder."""

import asyncio
import json
import os
from pathlib import Path

from safetensors import safe_open
from starlette.requests import Request
from starlette.responses import Response

from services.engine.responses import control

INDEX = "model.safetensors.index.json"


class DiskUpdates:
    def __init__(self, weights, folder: str | None):
        self.weights = weights
        self.folder = Path(folder).resolve() if folder else None
        self.updating = asyncio.Lock()  # one update at a time, as SGLang's model-update lock

    async def update_from_disk(self, request: Request) -> Response:
        body = await request.json()
        path, problem = self._allowed(body.get("model_path"))
        if problem:
            return control(False, f"Failed to get weights iterator: {problem}.", num_paused_requests=0)
        async with self.updating:
            try:
                names, tensors = await asyncio.to_thread(_read, path)
            except (OSError, ValueError, KeyError) as e:
                return control(False, f"Failed to get weights iterator: {e}.", num_paused_requests=0)
            problem = self.weights.check(names, [tensor.shape for tensor in tensors])
            if problem:
                return control(False, f"Failed to update weights: {problem}.", num_paused_requests=0)
            abort = bool(body.get("abort_all_requests"))
            await asyncio.wrap_future(self.weights.copy_in(names, tensors, body.get("weight_version"), abort))
        return control(True, "Succeeded to update model weights.", num_paused_requests=0)

    def _allowed(self, model_path) -> tuple[Path | None, str]:
        if not isinstance(model_path, str) or not model_path:
            return None, "model_path is required"
        if self.folder is None:
            return None, "this engine loads no weights from disk: start it with --weight-disk-dir <folder>"
        path = Path(model_path).resolve()
        if path != self.folder and self.folder not in path.parents:
            return None, f"model_path {model_path} is not under this engine's --weight-disk-dir {self.folder}"
        if not path.is_dir():
            return None, f"model_path {model_path} is not a folder"
        return path, ""

    def routes(self) -> list[tuple]:
        return [("/update_weights_from_disk", self.update_from_disk, ["POST"])]


def _read(folder: Path) -> tuple[list[str], list]:
    """Every tensor of the checkpoint in `folder`: of the files its index names, or of all its safetensors."""
    index = folder / INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors in {folder}")
    names, tensors = [], []
    for name in files:
        if os.sep in name or name.startswith(".."):
            raise ValueError(f"{INDEX} names {name!r}, not a file of the folder")
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                names.append(key)
                tensors.append(f.get_tensor(key))
    return names, tensors
