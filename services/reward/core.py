"""Scores reward items: picks each item's reward type, runs it (isolated worker, user function or remote model),
and turns what it returned into a reward, numeric details and text details — or an error result.
"""

import asyncio
import collections
import logging
import math
from dataclasses import dataclass

import prometheus_client
from google.protobuf.json_format import MessageToDict

from services.common.errors import InvalidArgument
from services.common.waits import logged_wait
from services.reward.config import RewardConfig
from services.reward.isolation import (
    Failure,
    RewardSample,
    WorkerPool,
    run_builtin,
    run_custom,
    run_custom_group,
    run_custom_trl,
    together,
)
from services.reward.remote import GrpcRewardModel, HttpRewardModel
from services.reward.verifiers import BUILT_IN, DEFAULT_RM_TYPE, NEEDS_LABEL, RM_TYPES, is_known
from slipstream.v1 import reward_pb2

log = logging.getLogger(__name__)

ITEMS = prometheus_client.Counter("slipstream_reward_items", "Items scored, by reward type", ["rm_type"])
ERRORS = prometheus_client.Counter(
    "slipstream_reward_errors",
    "Items whose reward failed, by reward type and kind (exception, timeout, memory, crash, invalid)",
    ["rm_type", "kind"],
)


MAX_TIMEOUT_S = 3600.0


@dataclass
class Scorer:
    config: RewardConfig
    pool: WorkerPool
    http: HttpRewardModel | None = None
    grpc: GrpcRewardModel | None = None
    trl_style: bool = False  # --custom-rm-path is a function written for TRL (trl_style.py): it scores a call at once

    def functions(self) -> list[tuple[str, bool, str]]:
        """(name, scores groups, description) of every reward this service offers."""
        if self.config.custom_rm_path:
            return [(self.config.custom_rm_path, self.config.group_rm, "custom reward function (--custom-rm-path)")]
        found = [(name, False, (fn.__doc__ or "").strip().split("\n")[0]) for name, fn in BUILT_IN.items()]
        if self.http:
            found.append(("remote_rm", False, f"HTTP reward model at {self.config.rm_url}"))
        if self.grpc:
            found.append(("remote_grpc", False, f"gRPC reward service at {self.config.rm_grpc_addr}"))
        return found

    async def score(self, items: list[reward_pb2.RewardItem], rm_type: str, timeout_s: float, group: bool = False):
        samples = [self._sample(i, item, rm_type) for i, item in enumerate(items)]
        if not 0 <= timeout_s <= MAX_TIMEOUT_S:  # also refuses NaN
            raise InvalidArgument(
                "timeout_seconds", f"must be 0 (the service's --rm-timeout-s) to {MAX_TIMEOUT_S}, got {timeout_s}"
            )
        timeout_s = timeout_s or self.config.rm_timeout_s
        if self.trl_style or (group and self.config.custom_rm_path and self.config.group_rm):
            return await self._score_group(samples, timeout_s)
        outcomes = [None] * len(samples)
        remote_grpc = [i for i, s in enumerate(samples) if s.rm_type == "remote_grpc"]
        if remote_grpc:
            answered = await self.grpc.score_items([_remote_item(items[i], samples[i]) for i in remote_grpc])
            for k, i in enumerate(remote_grpc):
                outcomes[i] = answered if isinstance(answered, Failure) else answered[k]
        await self._score_here(samples, outcomes, timeout_s)
        return [self._result(sample, outcome) for sample, outcome in zip(samples, outcomes, strict=True)]

    async def _score_here(self, samples: list[RewardSample], outcomes: list, timeout_s: float) -> None:
        """Fills in the outcomes not known yet: the workers' items go to the pool together (`WorkerPool.run_many`),
        while the HTTP reward model scores its own."""
        todo = [i for i, outcome in enumerate(outcomes) if outcome is None]
        for rm_type, count in collections.Counter(self.ran(samples[i]) for i in todo).items():
            ITEMS.labels(rm_type).inc(count)
        over_http, pooled, calls = [], [], []
        for i in todo:
            if samples[i].rm_type == "remote_rm" and not self.config.custom_rm_path:
                over_http.append(i)
            elif isinstance(call := self._call(samples[i]), Failure):
                outcomes[i] = call
            else:
                pooled.append(i)
                calls.append(call)
        with logged_wait(log, "%d items to be scored by the workers", len(pooled)):
            scored = await together(
                [self.pool.run_many(timeout_s, calls), *(self.http.score(samples[i]) for i in over_http)]
            )
        for i, outcome in zip(pooled + over_http, [*scored[0], *scored[1:]], strict=True):
            outcomes[i] = outcome

    def _sample(self, index: int, item: reward_pb2.RewardItem, rm_type: str) -> RewardSample:
        metadata = MessageToDict(item.metadata) if item.HasField("metadata") else {}
        chosen = item.rm_type or metadata.get("rm_type") or rm_type or self.config.rm_type or DEFAULT_RM_TYPE
        if not isinstance(chosen, str):
            raise InvalidArgument(f"items[{index}].metadata.rm_type", f"must be a string, got {chosen!r}")
        if not self.config.custom_rm_path:
            if not is_known(chosen):
                options = ", ".join(RM_TYPES)
                raise InvalidArgument(
                    f"items[{index}].rm_type", f"unknown reward type {chosen!r}; use one of {options}"
                )
            if chosen == "remote_rm" and self.http is None:
                raise InvalidArgument(f"items[{index}].rm_type", "remote_rm needs the service started with --rm-url")
            if chosen == "remote_grpc" and self.grpc is None:
                raise InvalidArgument(f"items[{index}].rm_type", "remote_grpc needs --rm-grpc-addr")
        response = item.response.decode("utf-8", errors="replace")
        return RewardSample(item.prompt, response, item.label, metadata, chosen, item.item_id or str(index))

    def ran(self, sample: RewardSample) -> str:
        """The reward that scores `sample`: "custom" for --custom-rm-path's function, else its reward type."""
        return "custom" if self.config.custom_rm_path else sample.rm_type

    def _call(self, sample: RewardSample) -> tuple | Failure:
        """What a worker runs for the item, as (function, *args), or why it need not run."""
        if self.config.custom_rm_path:
            return (run_custom, self.config.custom_rm_path, self.config, sample)
        if sample.rm_type.removeprefix("boxed_") in NEEDS_LABEL and not sample.label.strip():
            return Failure("invalid", f"label is empty; rm_type {sample.rm_type} compares the response with a label")
        return (run_builtin, sample.rm_type, sample.response, sample.label, sample.metadata)

    async def _score_group(self, samples: list[RewardSample], timeout_s: float):
        """Every item in one call of the custom function: --group-rm's (args, samples), or a TRL-style function's."""
        ITEMS.labels("custom_group").inc(len(samples))
        if self.trl_style:
            outcome = await self.pool.run(timeout_s, run_custom_trl, self.config.custom_rm_path, samples)
        else:
            outcome = await self.pool.run(timeout_s, run_custom_group, self.config.custom_rm_path, self.config, samples)
        if not isinstance(outcome, Failure) and (not isinstance(outcome, list | tuple) or len(outcome) != len(samples)):
            outcome = Failure("exception", f"the group reward function must return a list of {len(samples)} rewards")
        outcomes = outcome if isinstance(outcome, list | tuple) else [outcome] * len(samples)
        return [self._result(sample, value) for sample, value in zip(samples, outcomes, strict=True)]

    def _result(self, sample: RewardSample, outcome) -> reward_pb2.RewardResult:
        if isinstance(outcome, reward_pb2.RewardResult):  # from a remote RewardService, as it answered
            result = reward_pb2.RewardResult()
            result.CopyFrom(outcome)
            result.item_id = sample.item_id
            return result
        if isinstance(outcome, Failure):
            return self._error(sample, outcome)
        details, text = {}, {}
        if isinstance(outcome, dict):
            if self.config.reward_key not in outcome:
                keys = ", ".join(map(str, outcome))
                problem = (
                    f"no {self.config.reward_key!r} in the returned dict ({keys}); set --reward-key to one of them"
                )
                return self._error(sample, Failure("invalid", problem))
            for key, value in outcome.items():
                if isinstance(value, bool | int | float):
                    details[key] = float(value)
                else:
                    text[key] = str(value)
            outcome = outcome[self.config.reward_key]
        try:
            reward = float(outcome)
        except (TypeError, ValueError):
            return self._error(sample, Failure("invalid", f"returned {outcome!r}, not a number"))
        if not math.isfinite(reward):
            return self._error(sample, Failure("invalid", f"returned {reward}, not a finite number"))
        return reward_pb2.RewardResult(item_id=sample.item_id, reward=reward, details=details, text_details=text)

    def _error(self, sample: RewardSample, failure: Failure) -> reward_pb2.RewardResult:
        ran = self.ran(sample)
        ERRORS.labels(ran, failure.kind).inc()
        name = f"custom {self.config.custom_rm_path}" if self.config.custom_rm_path else ran
        message = f"item {sample.item_id} ({name}): {failure.kind}: {failure.message}"
        log.warning("%s", message)
        return reward_pb2.RewardResult(
            item_id=sample.item_id,
            reward=self.config.reward_on_error,
            error=True,
            error_message=message,
            rm_type=ran,
            error_kind=failure.kind,
            error_traceback=failure.traceback,
        )

    async def close(self) -> None:
        for remote in (self.http, self.grpc):
            if remote is not None:
                await remote.close()
        await asyncio.to_thread(self.pool.close)


def _remote_item(item: reward_pb2.RewardItem, sample: RewardSample) -> reward_pb2.RewardItem:
    """The item as the remote service should see it: its own default reward type, not ours."""
    remote = reward_pb2.RewardItem()
    remote.CopyFrom(item)
    remote.rm_type = ""
    remote.item_id = sample.item_id
    return remote
