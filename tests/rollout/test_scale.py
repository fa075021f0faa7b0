"""The whole rollout side with replicas, at full speed (bench/scale.py's harness: three buffer processes, two reward
processes and a gateway on one Redis, instant engines): a service that says it is ready serves its first request
without loading anything first, so no group waits for a load anywhere on the path.

On a many-core machine, a buffer that loaded its tokenizer on its first lease (seconds there) and reward workers
that imported their reward module on their first item held each group for seconds; replicas multiplied the stalls,
since the gateway's leases go round robin over buffers that each pay it once. Here the reward module takes 6 s to
import (tests/rollout/slow_reward.py, as a reward model's loading would), so that the stall shows on any machine: a
group that waits 4 s or more waited for it. The services log every wait over a second; on a loaded 2-core machine
waits of 1-2 s come from the load alone, so those are not the stall.
"""

import argparse
import json
import re
from pathlib import Path

from bench.gateway import start_instant_engines
from bench.scale import measure
from services.train.tiny_checkpoint import write_tiny_model

WAITED = re.compile(r" waited ([0-9.]+) s ")


def run(tmp_path: Path, **settings) -> tuple[dict, dict[str, str]]:
    """bench/scale.py's row for 3 buffer and 2 reward processes behind one gateway on 8 instant engines, and the
    services' logs."""
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(20_000)))
    defaults = {"concurrency": 16, "warm_up": 0.0, "seconds": 8.0, "log_level": "info", "profile": None,
                "custom_rm_path": None, "redis_cluster": 0, "data_workers": 0}  # fmt: skip
    args = argparse.Namespace(**(defaults | settings))
    urls, engines = start_instant_engines(8)
    try:
        row = measure(args, 8, 3, 2, 1, tmp_path / "run", model, data, urls, [p.pid for p in engines])
    finally:  # killed: a child forked from this process keeps its signal handlers, which SIGTERM would only run
        for process in engines:
            process.kill()
            process.join(10)
    return row, {log.name: log.read_text() for log in (tmp_path / "run").glob("*.log")}


def test_replicas_serve_at_once_and_no_group_waits_for_a_load(tmp_path: Path):
    row, logs = run(tmp_path, custom_rm_path="tests.rollout.slow_reward.reward")
    waits = [f"{name}: {line}" for name, text in logs.items() for line in text.splitlines()
             if (found := WAITED.search(line)) and float(found[1]) >= 4.0]  # fmt: skip
    assert not waits, "waits as long as the reward module's import, on the rollout path:\n" + "\n".join(waits[:20])
    assert row["completed"] >= 100, f"only {row['completed']} groups in 8 s: {row}"


def test_the_rollout_side_runs_on_a_redis_cluster(tmp_path: Path):
    """Every service on a real Redis Cluster of three nodes (--redis-cluster), the run's keys on one of them."""
    row, logs = run(tmp_path, redis_cluster=3, seconds=5.0)
    assert row["completed"] >= 100, f"only {row['completed']} groups in 5 s: {row}\n" + "\n".join(logs.values())
