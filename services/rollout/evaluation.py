"""Evaluation: one pass over each eval set the buffer holds, generated and scored like rollouts (alongside them,
through the same engines) and summarised as mean reward, pass@k and response-length statistics.

Eval sets are leased from the buffer by name, round after round; one pass is the groups of one round (the epoch of
the first group leased). Groups are submitted to the buffer, which keeps them under `eval:<name>`.
"""

import asyncio
import logging
import math

import numpy as np

from services.common.errors import InvalidArgument
from slipstream.v1 import buffer_pb2, common_pb2

log = logging.getLogger(__name__)

LEASE_CHUNK = 16


MAX_SAMPLES_PER_PROMPT = 1024
# Each override's bounds (SGLang's own checks, made here so that a bad value is the caller's error, not the engine's).
LIMITS = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "top_k": (-1, 1 << 20),
    "max_new_tokens": (0, 1 << 20),
    "min_new_tokens": (0, 1 << 20),
}


def check_sampling(overrides: common_pb2.SamplingParams) -> None:
    for descriptor, value in overrides.ListFields():
        low, high = LIMITS.get(descriptor.name, (None, None))
        if low is not None and not low <= value <= high:  # also refuses NaN
            raise InvalidArgument(f"sampling_params.{descriptor.name}", f"must be {low} to {high}, got {value}")


async def evaluate(rollout, datasets: list[str], n: int, overrides: common_pb2.SamplingParams) -> dict[str, dict]:
    """Metrics of each named eval set (all of them when `datasets` is empty): {name: {metric: value}}."""
    state = await rollout.buffer.GetState(buffer_pb2.GetStateRequest(), timeout=30)
    known = list(state.eval_datasets)
    unknown = [d for d in datasets if d not in known]
    if unknown:
        names = ", ".join(known) or "none (start the buffer with --eval-prompt-data NAME PATH or --eval-config FILE)"
        raise InvalidArgument("datasets", f"unknown eval set(s) {', '.join(unknown)}; the buffer has {names}")
    if not 0 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise InvalidArgument("n_samples_per_prompt", f"must be 0 (the buffer's) to {MAX_SAMPLES_PER_PROMPT}, got {n}")
    check_sampling(overrides)
    names = datasets or known
    passes = (_one_pass(rollout, name, n, rollout.sampling(overrides, evaluation=True, dataset=name)) for name in names)
    results = await asyncio.gather(*passes)
    return dict(zip(names, results, strict=True))


async def _one_pass(rollout, name: str, n: int, sampling: dict) -> dict:
    slots = asyncio.Semaphore(rollout.config.rollout_concurrency)
    tasks, epoch = [], None

    async def run(lease):
        async with slots:
            return await rollout.run_group(lease, sampling, n)

    while True:
        request = buffer_pb2.LeasePromptsRequest(
            max_groups=LEASE_CHUNK, lease_seconds=rollout.config.lease_seconds, dataset=name
        )
        reply = await rollout.buffer.LeasePrompts(request, timeout=30)
        if not reply.leases:
            break
        epoch = reply.leases[0].group.epoch if epoch is None else epoch
        next_round = [lease for lease in reply.leases if lease.group.epoch != epoch]
        tasks += [asyncio.create_task(run(lease)) for lease in reply.leases if lease.group.epoch == epoch]
        for lease in next_round:  # the next pass starts with these
            await rollout._release(lease.lease_id, "belongs to the next evaluation pass")
        if next_round:
            break
    groups = [g for g in await asyncio.gather(*tasks) if g is not None]
    if len(groups) < len(tasks):
        log.warning("eval set %s: %d of %d groups could not be finished", name, len(tasks) - len(groups), len(tasks))
    return summarize(groups)


def summarize(groups: list[common_pb2.PromptGroup]) -> dict:
    """Mean reward, pass@k (k = 1, 2, 4, … up to the samples per prompt; a sample passes when its reward is > 0),
    and response-length statistics."""
    if not groups:
        return {"num_samples": 0, "mean_reward": 0.0}
    rewards = np.array([s.reward for g in groups for s in g.samples])
    lengths = np.array([s.response_length for g in groups for s in g.samples])
    truncated = sum(s.status == common_pb2.SAMPLE_STATUS_TRUNCATED for g in groups for s in g.samples)
    failed = sum(s.HasField("reward_error") for g in groups for s in g.samples)  # scored 0: said beside the mean
    metrics = {
        "num_samples": float(len(rewards)),
        "mean_reward": float(rewards.mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/p50": float(np.median(lengths)),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "truncated_ratio": truncated / len(rewards),
        "reward_failed": failed / len(rewards),
    }
    k = 1
    while k <= min(len(g.samples) for g in groups):
        metrics[f"pass@{k}"] = float(np.mean([pass_at_k(g, k) for g in groups]))
        k *= 2
    return metrics


def pass_at_k(group: common_pb2.PromptGroup, k: int) -> float:
    """The unbiased estimate of pass@k from n samples with c passing: 1 - C(n-c, k) / C(n, k)."""
    n, c = len(group.samples), sum(s.reward > 0 for s in group.samples)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
