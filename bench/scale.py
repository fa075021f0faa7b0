"""Scale: groups/s through the whole rollout side, and the latency it adds, as the services grow: G gateways (a fleet,
services/rollout/fleet.py), B buffer and R reward replicas on one Redis, and K instant engines. Every service is
its own process, as deployed; the instant engines (bench/gateway.py: a benchmark-only fixture that answers every
SGLang route at once, with no model) make the figures the services' own. No trainer: the buffer lets groups
accumulate (no staleness bound), so that generation never waits for training.

For each G of --gateways it starts the services, lets them warm up, then counts completed groups over --seconds.
Latency is each group's time from its lease to its score (what a gateway, the buffer and the reward service add
with instant engines), p50 and p99 over the groups completed in the window. Redis's load is its commands and bytes
(in plus out) per second over the window, from INFO.

Run: .venv/bin/python bench/scale.py --engines 64 --gateways 1 2 4 --buffers 2 --rewards 2 [--seconds 20]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import start_instant_engines
from services.common.clients import wait_until_serving
from services.common.processes import free_port
from services.common.redis_connection import EmbeddedRedis
from services.common.tiny_checkpoint import write_tiny_model
from slipstream.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RUN = "scale"


def start(module: str, *args: str, folder: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = open(folder / f"{module.rsplit('.', 1)[-1]}-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
    command = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "null",
               "--log-level", "warning", *args]  # fmt: skip
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    return f"127.0.0.1:{port}", proc


def measure(args, gateways: int, folder: Path, model: Path, data: Path, engine_urls: list[str]) -> dict:
    server = EmbeddedRedis(folder / f"redis-{gateways}").start()
    client = redis.Redis.from_url(server.url)
    procs: list[subprocess.Popen] = []
    try:
        addresses = {"buffer": [], "reward": [], "rollout": []}
        common = ["--run-id", RUN, "--redis-url", server.url]
        for _ in range(args.buffers):
            address, proc = start("services.buffer", *common, "--prompt-data", str(data), "--hf-checkpoint",
                                  str(model), "--num-data-workers", "0", "--max-staleness", "1000000",
                                  "--rollout-batch-size", "64", folder=folder)  # fmt: skip
            addresses["buffer"].append(address)
            procs.append(proc)
        for _ in range(args.rewards):
            address, proc = start("services.reward", "--rm-type", "random", "--num-workers", "1", folder=folder)
            addresses["reward"].append(address)
            procs.append(proc)
        for address in addresses["buffer"] + addresses["reward"]:
            wait_until_serving(address, timeout_s=120)
        target = {name: "ipv4:" + ",".join(found) for name, found in addresses.items() if found}
        for _ in range(gateways):
            address, proc = start("services.rollout", *common, "--buffer-addr", target["buffer"], "--reward-addr",
                                  target["reward"], "--rollout-concurrency", str(args.concurrency),
                                  "--engine-urls", *engine_urls, folder=folder)  # fmt: skip
            addresses["rollout"].append(address)
            procs.append(proc)
        for address in addresses["rollout"]:
            wait_until_serving(address, timeout_s=120)
        with grpc.insecure_channel(addresses["rollout"][0]) as channel:
            rollout_pb2_grpc.RolloutServiceStub(channel).StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)
        time.sleep(args.warm_up)
        counters, done = f"slipstream:{{{RUN}}}:counters", f"slipstream:{{{RUN}}}:done"
        before, info0, t0 = int(client.hget(counters, "completed") or 0), client.info(), time.monotonic()
        time.sleep(args.seconds)
        after, info1, t1 = int(client.hget(counters, "completed") or 0), client.info(), time.monotonic()
        elapsed = t1 - t0
        if after == before:
            logs = "".join(log.read_text()[-2000:] for log in folder.glob("rollout-*.log"))
            raise RuntimeError(f"no group completed with G={gateways}; the gateways' logs end:\n{logs}")
        window = [gid.decode() for gid in client.zrangebyscore(done, before + 1, after)]  # completed in the window
        latencies = []
        for gid in window[:: max(1, len(window) // 2000)]:
            group = common_pb2.PromptGroup.FromString(client.get(f"slipstream:{{{RUN}}}:done:{gid}") or b"")
            if "scored" in group.timings and "leased" in group.timings:
                latencies.append(group.timings["scored"] - group.timings["leased"])
        latencies.sort()
        moved = sum(info1[k] - info0[k] for k in ("total_net_input_bytes", "total_net_output_bytes"))
        return {
            "groups_s": (after - before) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
            "redis_ops_s": (info1["total_commands_processed"] - info0["total_commands_processed"]) / elapsed,
            "redis_mb_s": moved / elapsed / 2**20,
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        client.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--buffers", type=int, default=2)
    parser.add_argument("--rewards", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="groups in flight per gateway")
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--warm-up", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--engine-processes", type=int, default=max(1, (os.cpu_count() or 1) // 8),
                        help="processes serving the instant engines (one would be the bottleneck)")  # fmt: skip
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="slipstream-scale-"))
    model = write_tiny_model(folder / "model")
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(args.prompts)))
    urls, engines = start_instant_engines(args.engines, args.engine_processes)
    rows = []
    try:
        for gateways in args.gateways:
            rows.append((gateways, measure(args, gateways, folder, model, data, urls)))
            print(f"G={gateways}: {rows[-1][1]}", file=sys.stderr)
    finally:
        for process in engines:
            process.terminate()
    base = rows[0][1]["groups_s"] / rows[0][0]
    print(f"\n{args.engines} instant engines (benchmark-only fixture, {args.engine_processes} processes), "
          f"{args.buffers} buffer and {args.rewards} reward "
          f"replicas on one Redis, {args.concurrency} groups in flight per gateway, 1 sample a group; "
          f"{os.cpu_count()} CPU cores; {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print("| gateways | groups/s | of linear | lease→score p50 ms | p99 ms | Redis ops/s | Redis MB/s |")
    print("|---|---|---|---|---|---|---|")
    for gateways, row in rows:
        share = row["groups_s"] / (base * gateways)
        print(f"| {gateways} | {row['groups_s']:.0f} | {share:.0%} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
              f"{row['redis_ops_s']:.0f} | {row['redis_mb_s']:.2f} |")  # fmt: skip
    gateways = " ".join(str(g) for g in args.gateways)
    print(f"\nReproduce: .venv/bin/python bench/scale.py --engines {args.engines} --gateways {gateways} "
          f"--buffers {args.buffers} --rewards {args.rewards} --concurrency {args.concurrency} "
          f"--engine-processes {args.engine_processes} --seconds {args.seconds:g}")  # fmt: skip


if __name__ == "__main__":
    main()
