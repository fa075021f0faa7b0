"""The run's LoRA adapter on the engines (--lora-rank): each weight sync is a peft folder that every engine loads
under a name of its own (`<run id>-v<version>`, so that runs sharing the engines never meet), and every /generate
asks for the live one by that name (SGLang's `lora_path`). The sample's weight version is the adapter's version that
generated it: the engines' own version label is the base weights', shared by every run on them.

An engine admitted after a sync (new, or restarted) loads the live adapter before its first request. Once a newer
version is live, the older one is unloaded from each engine as soon as no request of this gateway uses it (one
waiting for an engine's slot included: SGLang refuses a request for an adapter being unloaded)."""

import asyncio
import collections
import contextlib
import logging

log = logging.getLogger(__name__)

# The linear layers an adapter may target, by the trainer's --target-modules names (SGLang's --lora-target-modules).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def server_options(config) -> list[str]:
    """The engines' options for serving the run's adapters (SGLang's names; the reference engine takes them)."""
    if not config.lora_rank:
        return []
    modules = [m for t in config.target_modules for m in (ALL_LINEAR if t == "all-linear" else (t,))]
    return ["--enable-lora", "--max-lora-rank", str(config.lora_rank), "--lora-target-modules", *dict.fromkeys(modules)]


class Adapters:
    def __init__(self, pool, run_id: str):
        self.pool, self.run_id = pool, run_id
        self.live: tuple[int, str, str] | None = None  # (version, name, folder) of the adapter generation uses
        self.held: dict[str, set[str]] = {}  # engine url → the adapter names it holds
        self._loading: dict[str, asyncio.Lock] = {}
        self._unloads: set[asyncio.Task] = set()
        self.using: collections.Counter[str] = collections.Counter()  # requests in flight by adapter name
        self._idle: dict[str, asyncio.Event] = {}  # set once no request uses the adapter

    def name(self, version: int) -> str:
        return f"{self.run_id}-v{version}"

    async def request(self, engine, payload: dict) -> tuple[dict, int | None]:
        """`payload` asking for the live adapter (loaded on `engine` first if it lacks it), and its version; the
        adapter counts as used until `done`."""
        if self.live is None:
            return payload, None
        version, name, folder = self.live
        if engine is not self.pool.router and name not in self.held.get(engine.url, ()):
            async with self._loading.setdefault(engine.url, asyncio.Lock()):
                if name not in self.held.get(engine.url, ()):
                    await self.pool._post(engine, "/load_lora_adapter", {"lora_name": name, "lora_path": folder})
                    self.held.setdefault(engine.url, set()).add(name)
        self.using[name] += 1
        return {**payload, "lora_path": name}, version

    def done(self, payload: dict) -> None:
        name = payload.get("lora_path")
        if name:
            self.using[name] -= 1
            if not self.using[name]:
                del self.using[name]
                if event := self._idle.pop(name, None):
                    event.set()

    @staticmethod
    def label(answer, version: int | None):
        """The answer's weight versions are the adapter's that generated it."""
        if version is not None:
            for output in answer if isinstance(answer, list) else [answer]:
                meta = output.get("meta_info") or {}
                meta.pop("weight_versions", None)
                meta["weight_version"] = str(version)
        return answer

    def committed(self, version: int, folder: str, loaded: list[str]) -> None:
        """Version `version` (loaded from `folder` by the engines at `loaded`) is live: requests ask for it from now
        on, and the older adapters are unloaded in the background."""
        name = self.name(version)
        self.live = (version, name, folder)
        for url in loaded:
            self.held.setdefault(url, set()).add(name)
        for url, names in self.held.items():
            for old in [n for n in names if n != name]:
                names.discard(old)
                task = asyncio.create_task(self._unload(url, old))
                self._unloads.add(task)
                task.add_done_callback(self._unloads.discard)

    def forget(self, url: str) -> None:
        """An evicted engine may come back restarted, holding nothing."""
        self.held.pop(url, None)

    async def _unload(self, url: str, name: str) -> None:
        if self.using.get(name):  # no new request asks for it: the live adapter is another one
            await self._idle.setdefault(name, asyncio.Event()).wait()
        engine = self.pool.engines.get(url)
        if engine is None:
            return
        try:
            await self.pool._post(engine, "/unload_lora_adapter", {"lora_name": name})
        except Exception as e:  # an engine that restarted holds nothing; one that failed is evicted by its health
            log.warning("could not unload LoRA adapter %s from %s: %s", name, url, e)

    async def close(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._unloads, return_exceptions=True)
