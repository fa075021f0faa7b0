"""The gateway's side of weight sync (DESIGN.md "Weight sync", SGLANG_API.md §3): it sets up the process group
between the trainer (rank 0) and every engine's TP ranks, pauses generation, forwards each bucket's tensor specs to
all engines at once while the trainer broadcasts, then commits the version (engines, generation, buffer).

Every engine call has a deadline; an engine that fails is evicted and the sync goes on with the others. The group is
kept across syncs and rebuilt only when the engines taking part change.
"""

import asyncio
import logging
from dataclasses import dataclass

from services.common.errors import FailedPrecondition, Unavailable
from services.rollout.config import RolloutConfig
from services.rollout.engines import Engine, EngineFailure, EnginePool
from slipstream.v1 import buffer_pb2

log = logging.getLogger(__name__)

SESSION_VERSION = (0, 5, 21)  # SGLang from this version needs begin/end_weight_update around updates


@dataclass
class Group:
    name: str
    members: tuple  # ((url, tp_size), ...) in rank order
    address: tuple  # (master address, port, backend)


@dataclass
class Result:
    url: str
    success: bool
    message: str


class WeightSync:
    def __init__(self, config: RolloutConfig, pool: EnginePool, buffer):
        self.config, self.pool, self.buffer = config, pool, buffer
        self.group: Group | None = None
        self.engines: list[Engine] = []  # taking part in the current sync
        self.version: int | None = None
        self._joining: asyncio.Task | None = None

    async def prepare(self, version: int, address: str, port: int, group_name: str, backend: str):
        """Returns (world size, [(url, rank offset, tp size)], whether the trainer must join a new group)."""
        if self.version is not None and self.version != version:
            raise FailedPrecondition(f"the sync of version {self.version} is still open; commit or abort it first")
        engines = self.pool.healthy()
        if not engines:
            raise Unavailable("no healthy engine to send weights to; register one (RegisterEngine) first")
        members = tuple((e.url, e.tp_size) for e in engines)
        created = self.group != Group(group_name, members, (address, port, backend))
        offsets = [1 + sum(tp for _, tp in members[:i]) for i in range(len(members))]
        world_size = 1 + sum(tp for _, tp in members)
        if created:
            if self.group is not None:
                await self._each(
                    self.engines or engines, "/destroy_weights_update_group", {"group_name": self.group.name}
                )
            self.group = Group(group_name, members, (address, port, backend))
            common = {"master_address": address, "master_port": port, "world_size": world_size,
                      "group_name": group_name, "backend": backend}  # fmt: skip
            per_engine = {e.url: {**common, "rank_offset": o} for e, o in zip(engines, offsets, strict=True)}
            # Each engine's call returns only once the trainer has joined too: it runs while Prepare answers.
            self._joining = asyncio.create_task(self._each(engines, "/init_weights_update_group", {}, per_engine))
        self.engines, self.version = engines, version
        await self.pool.pause(self.config.pause_mode)
        await self._each(self._session_engines(), "/begin_weight_update", {"selector": "all"})
        ranks = [(url, offset, tp) for (url, tp), offset in zip(members, offsets, strict=True)]
        return world_size, ranks, created

    async def bucket(self, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str) -> list:
        """Posts one bucket to every engine at once; answers once each has loaded it (or failed and was evicted)."""
        self._check_open()
        failed = await self._joined()
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group.name,
                "load_format": load_format or None, "flush_cache": False}  # fmt: skip
        results = await self._each(self.engines, "/update_weights_from_distributed", body)
        return failed + results

    async def commit(self, version: int) -> list[Result]:
        self._check_open(version)
        failed = await self._joined()
        await self._each(self._session_engines(), "/end_weight_update", {})
        body = {"new_version": str(version), "abort_all_requests": False}
        results = await self._each(self.engines, "/update_weight_version", body)
        await self.pool.resume()
        for engine in self.engines:
            engine.weight_version = str(version)
        await self.buffer.SetPolicyVersion(buffer_pb2.SetPolicyVersionRequest(version=version), timeout=30)
        self.version = None
        log.info("weights of version %d are live on %d engine(s)", version, sum(r.success for r in results))
        return failed + results

    async def abort(self, version: int, reason: str) -> None:
        """Ends the open sync: engines keep their old weights and generate again; the next sync rebuilds the group."""
        log.warning("weight sync of version %d aborted: %s", version, reason or "no reason given")
        if self._joining is not None:
            self._joining.cancel()
        if self.engines:
            await self._each(self._session_engines(), "/end_weight_update", {})
            await self._each(self.engines, "/destroy_weights_update_group", {"group_name": self.group.name})
        await self.pool.resume()
        self.group, self._joining, self.version = None, None, None

    # Plumbing

    def _check_open(self, version: int | None = None) -> None:
        if self.version is None or (version is not None and version != self.version):
            raise FailedPrecondition(
                f"no weight sync of version {version or '?'} is open; call PrepareWeightSync first"
            )

    def _session_engines(self) -> list[Engine]:
        return [e for e in self.engines if _version(e.version) >= SESSION_VERSION]

    async def _joined(self) -> list[Result]:
        """Waits for the group to be formed; engines that could not join are dropped from this sync."""
        if self._joining is None:
            return []
        results, self._joining = await self._joining, None
        return [r for r in results if not r.success]

    async def _each(self, engines: list[Engine], path: str, body: dict, per_engine: dict | None = None) -> list[Result]:
        """Posts `body` (or `per_engine[url]`) to every engine concurrently; an engine that fails is evicted and
        leaves the current sync."""
        engines = list(engines)  # a copy: failures leave self.engines while the results are read
        calls = [self._call(e, path, (per_engine or {}).get(e.url, body)) for e in engines]
        results = await asyncio.gather(*calls)
        for engine, result in zip(engines, results, strict=True):
            if not result.success and engine in self.engines:
                self.engines.remove(engine)
                self.pool.evict(engine, f"{path} failed: {result.message}")
        return results

    async def _call(self, engine: Engine, path: str, body: dict) -> Result:
        try:
            reply = await self.pool.post_control(engine, path, body, self.config.weight_sync_timeout_s)
        except EngineFailure as e:
            return Result(engine.url, False, str(e))
        return Result(engine.url, bool(reply.get("success", True)), str(reply.get("message", "")))


def _version(text: str) -> tuple:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)
