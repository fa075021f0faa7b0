"""LoRA adapters served beside the base weights, as SGLang serves them under --enable-lora: /load_lora_adapter reads
a peft adapter folder (adapter_config.json, adapter_model.safetensors) under a name, a /generate request names the
adapter of each prompt in `lora_path`, and /unload_lora_adapter stops new requests from using one at once and frees
it once the sequences using it finished.

Each targeted linear layer of the model gets a forward hook that adds scale · B(A(x)) to the tokens of the sequences
that use an adapter, so that one batch mixes adapters (and tokens with none). The base model keeps its modules and
parameter names: full weight updates load into it as without LoRA."""

import asyncio
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from starlette.requests import Request
from starlette.responses import Response

from services.engine.responses import json_response

log = logging.getLogger(__name__)

PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
ALL_LINEAR = "all-linear"


class LoraError(ValueError):
    """A request for an adapter this engine cannot serve; the message says why (SGLang's wording)."""


@dataclass
class Adapter:
    name: str
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name → (A [r, in], B [out, r])
    running: int = 0  # sequences using it now
    unloading: bool = False
    unloaded: list = field(default_factory=list)  # futures of the unload calls waiting for `running` to reach 0


class Adapters:
    """The engine's adapters. `select` is called by the batcher before each forward: for each adapter in use, the
    indices of the tokens of its flat input [1, tokens] that it applies to, and of the positions whose logits the
    forward keeps (what the output layer sees)."""

    def __init__(self, model: torch.nn.Module, max_rank: int, target_modules: list[str]):
        self.model, self.max_rank, self.targets = model, max_rank, set(target_modules)
        self.loaded: dict[str, Adapter] = {}
        self.tokens: dict[str, torch.Tensor] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()  # `loaded` and the counts: requests arrive on the server's thread
        self._hooked: set[str] = set()
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        output = model.get_output_embeddings()
        self.output_layer = next((n for n, m in self._linears.items() if m is output), None)  # sees kept positions

    # On the engine thread (between steps)

    def select(self, tokens: dict[str, torch.Tensor], kept: dict[str, torch.Tensor]) -> None:
        self.tokens, self.kept = tokens, kept

    def load(self, name: str, path: str) -> None:
        if name in self.loaded:
            raise LoraError(f"The LoRA adapter {name} is already loaded.")
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            from safetensors.torch import load_file

            tensors = load_file(folder / "adapter_model.safetensors")
        except (OSError, ValueError) as e:
            raise LoraError(f"Failed to load LoRA adapter {name} from {path}: {e}") from None
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        if rank > self.max_rank:
            raise LoraError(f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.max_rank}.")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = PEFT_KEY.match(key)
            if match is None:
                raise LoraError(f"LoRA adapter {name}: {key} is not a LoRA weight (lora_A / lora_B)")
            parts.setdefault(match["module"], {})[match["part"]] = tensor
        weights = {}
        for module, pair in parts.items():
            linear = self._linears.get(module)
            if linear is None or set(pair) != {"A", "B"}:
                raise LoraError(f"LoRA adapter {name}: {module} is not a linear layer of this model, or lacks A or B")
            if not self.targets & {ALL_LINEAR, "all"} and module.rsplit(".", 1)[-1] not in self.targets:
                raise LoraError(f"LoRA adapter {name} targets {module}, outside --lora-target-modules")
            weight = linear.weight
            weights[module] = tuple(t.to(weight.device, weight.dtype) for t in (pair["A"], pair["B"]))
            if module not in self._hooked:
                linear.register_forward_hook(self._hook(module))
                self._hooked.add(module)
        with self.lock:
            self.loaded[name] = Adapter(name, alpha / rank, weights)
        log.info("LoRA adapter %s loaded from %s (rank %d, %d layers)", name, path, rank, len(weights))

    def unload(self, name: str, done) -> None:
        """Stops new requests from using it now; `done` (a Future) is resolved once it is gone."""
        with self.lock:
            adapter = self.loaded.get(name)
            if adapter is None or adapter.unloading:
                live = [n for n, a in self.loaded.items() if not a.unloading]
                raise LoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {live}")
            adapter.unloading = True
            adapter.unloaded.append(done)
            self._release(adapter)

    def acquire(self, names: list[str | None]) -> None:
        """Counts a request's sequences as using their adapters, or refuses the request (none counted)."""
        with self.lock:
            for name in filter(None, names):
                adapter = self.loaded.get(name)
                if adapter is None or adapter.unloading:
                    live = [n for n, a in self.loaded.items() if not a.unloading]
                    raise LoraError(
                        f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {live}."
                    )
            for name in filter(None, names):
                self.loaded[name].running += 1

    def finished(self, name: str | None) -> None:
        with self.lock:
            if name is not None and name in self.loaded:
                adapter = self.loaded[name]
                adapter.running -= 1
                self._release(adapter)

    def _release(self, adapter: Adapter) -> None:
        if adapter.unloading and adapter.running == 0:
            del self.loaded[adapter.name]
            for done in adapter.unloaded:
                done.set_result(None)
            log.info("LoRA adapter %s unloaded", adapter.name)

    def _hook(self, module: str):
        def add_delta(_, inputs, output):
            x, out = inputs[0].flatten(0, -2), output.view(-1, output.shape[-1])
            for name, index in (self.kept if module == self.output_layer else self.tokens).items():
                adapter = self.loaded.get(name)
                if adapter is None or module not in adapter.weights:
                    continue
                a, b = adapter.weights[module]
                out[index] += adapter.scale * (x[index] @ a.T @ b.T)
            return output

        return add_delta


class LoraRoutes:
    """/load_lora_adapter and /unload_lora_adapter as SGLang serves them (LoRAUpdateOutput answers). The reference
    engine loads adapters only from under its --weight-disk-dir (SGLang loads any path): a request names no other
    folder."""

    def __init__(self, engine, folder: str | None):
        self.engine, self.folder = engine, Path(folder).resolve() if folder else None

    async def load(self, request: Request) -> Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if self.engine.adapters is None:
            return _answer(self.engine, "LoRA is not enabled: start the engine with --enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str):
            return _answer(self.engine, "lora_name and lora_path are required")
        resolved = Path(path).resolve()
        if self.folder is None or (resolved != self.folder and self.folder not in resolved.parents):
            where = self.folder or "none: start the engine with --weight-disk-dir <folder>"
            return _answer(self.engine, f"lora_path {path} is not under this engine's --weight-disk-dir ({where})")
        try:
            await asyncio.wrap_future(self.engine.call(lambda: self.engine.adapters.load(name, str(resolved))))
        except LoraError as e:
            return _answer(self.engine, str(e))
        return _answer(self.engine)

    async def unload(self, request: Request) -> Response:
        body = await request.json()
        if self.engine.adapters is None:
            return _answer(self.engine, "LoRA is not enabled: start the engine with --enable-lora")
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        resolve = lambda _: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))  # noqa: E731
        waiter = _ThreadsafeFuture(resolve)
        try:
            self.engine.adapters.unload(str(body.get("lora_name")), waiter)
        except LoraError as e:
            return _answer(self.engine, str(e))
        await done  # once the sequences using it finished, as SGLang waits for them
        return _answer(self.engine)

    def routes(self) -> list[tuple]:
        return [("/load_lora_adapter", self.load, ["POST"]), ("/unload_lora_adapter", self.unload, ["POST"])]


class _ThreadsafeFuture:
    """What Adapters.unload resolves, from whichever thread releases the adapter."""

    def __init__(self, resolve):
        self.resolve = resolve

    def set_result(self, value) -> None:
        self.resolve(value)


def _answer(engine, error: str = "") -> Response:
    loaded = {} if engine.adapters is None else {n: n for n, a in engine.adapters.loaded.items() if not a.unloading}
    body = {"success": not error, "error_message": error or None, "loaded_adapters": loaded}
    return json_response(body, 400 if error else 200)
