"""Scale: groups/s through the whole rollout side, and the latency it adds, as the services grow: G gateways (a fleet,
services/rollout/fleet.py), B buffer and R reward replicas on one Redis, and K instant engines. Every service is
its own process, as deployed; the instant engines (bench/gateway.py: a benchmark-only fixture that answers every
SGLang route at once, with no model) make the figures the services' own. No trainer: the buffer lets groups
accumulate (no staleness bound), so that generation never waits for training.

For each K of --engines, B of --buffers, R of --rewards and G of --gateways it starts the services, lets them warm
up, then counts completed groups over --seconds. Latency is each group's time from its lease to its score (what a
gateway, the buffer and the reward service add with instant engines), p50 and p99 over the groups completed in the
window. Redis's load is its commands and bytes (in plus out) per group, from INFO; LeasePrompts calls a group are the
buffers' (their RPC counters) over the groups completed, and groups a call the groups leased over those calls (the
few that come back empty count as calls); CPU is each kind of process's CPU time per group in the window, and
"busiest" the one process that used the most cores (the bottleneck when near 1).

It fails, printing every service's log tail, when a row collapses: no group completed, a p50 over a second (the
engines answer at once: such a group waited on a timer), a p99 over 100 x p50, or groups/s per gateway under a tenth
of the best row's.

Run: .venv/bin/python bench/scale.py --engines 64 --gateways 1 2 4 --buffers 3 --rewards 2 [--seconds 20]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway import start_instant_engines
from bench.redis_cluster import RedisCluster
from services.buffer import dataplane
from services.common.clients import wait_until_serving
from services.common.processes import free_port
from services.common.redis_connection import EmbeddedRedis
from services.train.tiny_checkpoint import write_tiny_model
from slipstream.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RUN = "scale"
KINDS = ("rollout", "buffer", "reward", "redis", "engines")


def start(module: str, *args: str, folder: Path, log_level: str, metrics_port: int | None = None
          ) -> tuple[str, subprocess.Popen]:  # fmt: skip
    port = free_port()
    log = open(folder / f"{module.rsplit('.', 1)[-1]}-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
    command = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
               str(metrics_port or "null"), "--log-level", log_level, *args]  # fmt: skip
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    return f"127.0.0.1:{port}", proc


class Embedded:
    """The embedded Redis as the benchmark uses a Redis (bench/redis_cluster.py's shape)."""

    cluster = False

    def __init__(self, folder: Path):
        self.server = EmbeddedRedis(folder / "redis").start()
        self.url = self.server.url

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def pid_of(self, key: str) -> int:
        return self.server.pid

    def stop(self) -> None:
        self.server.stop()


def start_redis(folder: Path, cluster_nodes: int):
    """The run's Redis: the embedded server, or a Redis Cluster of `cluster_nodes` nodes."""
    return RedisCluster(cluster_nodes, folder / "cluster").start() if cluster_nodes else Embedded(folder)


def scrape(ports: list[int], name: str, label: str = "") -> float:
    """The sum over the processes at `ports` of the Prometheus samples called `name` (whose labels hold `label`)."""
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.split("{", 1)[0].split(" ", 1)[0] == name and label in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def rpc_figures(ports: dict[str, list[int]]) -> dict[str, float]:
    """The counters the table reads from the services' /metrics: the buffers' LeasePrompts calls, their time in
    them, the times a lease waited for a read-ahead and the read-aheads another buffer beat, and the gateways' time
    waiting on those calls."""
    lease = 'method="LeasePrompts"'
    return {
        "calls": scrape(ports["buffer"], "slipstream_rpc_requests_total", lease),
        "served_s": scrape(ports["buffer"], "slipstream_rpc_latency_seconds_sum", lease),
        "contended": scrape(ports["buffer"], "slipstream_buffer_lease_contended_total"),
        "waited": scrape(ports["buffer"], "slipstream_buffer_lease_waited_total"),
        "waited_s": scrape(ports["rollout"], "slipstream_rollout_lease_seconds_sum"),
        "waits": scrape(ports["rollout"], "slipstream_rollout_lease_seconds_count"),
    }


def cpu_seconds(pids: dict[str, list[int]]) -> dict[int, float]:
    """CPU seconds used so far by each process, its children included (the reward's workers)."""
    used = {}
    for pid in (pid for found in pids.values() for pid in found):
        try:
            proc = psutil.Process(pid)
            times = [proc.cpu_times()] + [child.cpu_times() for child in proc.children(recursive=True)]
        except psutil.Error:
            continue
        used[pid] = sum(t.user + t.system for t in times)
    return used


def thread_seconds(pids: dict[str, list[int]]) -> dict[tuple[str, str], float]:
    """CPU seconds used so far by each kind of process's threads, by thread name (children included): which
    thread of a process burns its time (the event loop, gRPC's pollers, a tokenizer's or OpenMP's pool)."""
    used: dict[tuple[str, str], float] = {}
    for kind, found in pids.items():
        for pid in found:
            try:
                procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                for proc in procs:
                    for thread in proc.threads():
                        name = Path(f"/proc/{proc.pid}/task/{thread.id}/comm").read_text().strip()
                        name = "main" if thread.id == proc.pid else name.rstrip("0123456789-_")
                        used[kind, name] = used.get((kind, name), 0.0) + thread.user_time + thread.system_time
            except (psutil.Error, OSError):
                continue
    return used


def profile(pids: dict[str, list[int]], folder: Path, py_spy: str, seconds: float) -> None:
    """py-spy's samples of every service process over `seconds` (where their CPU time goes), as
    collapsed stacks beside their logs."""
    runs = []
    for kind, found in pids.items():
        for pid in found:
            out = folder / f"pyspy-{kind}-{pid}.txt"
            command = [py_spy, "record", "--pid", str(pid), "--nonblocking", "--format", "raw",
                       "--rate", "200", "--duration", str(max(1, round(seconds))), "--output", str(out)]  # fmt: skip
            runs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for run in runs:
        run.wait()


def measure(args, engines: int, buffers: int, rewards: int, gateways: int, folder: Path, model: Path, data: Path,
            engine_urls: list[str], engine_pids: list[int]) -> dict:  # fmt: skip
    folder.mkdir(parents=True)
    server = start_redis(folder, args.redis_cluster)
    client = server.client()
    ns = dataplane.namespace("slipstream", RUN)
    run_node = client.get_redis_connection(client.get_node_from_key(ns)) if server.cluster else client
    procs: dict[str, list[subprocess.Popen]] = {"buffer": [], "reward": [], "rollout": []}
    addresses: dict[str, list[str]] = {"buffer": [], "reward": [], "rollout": []}

    metrics_ports: dict[str, list[int]] = {"buffer": [], "rollout": []}  # their counters: the LeasePrompts calls

    def add(kind: str, *flags: str) -> None:
        metrics_port = free_port() if kind in metrics_ports else None
        metrics_ports.get(kind, []).append(metrics_port)
        address, proc = start(f"services.{kind}", *flags, folder=folder, log_level=args.log_level,
                              metrics_port=metrics_port)  # fmt: skip
        addresses[kind].append(address)
        procs[kind].append(proc)

    try:
        common = ["--run-id", RUN, "--redis-url", server.url, *(["--redis-cluster"] if server.cluster else []),
                  "--n-samples-per-prompt", "1"]  # fmt: skip  # the instant engines answer one sample a request
        for _ in range(buffers):
            add("buffer", *common, "--prompt-data", str(data), "--hf-checkpoint", str(model), "--num-data-workers",
                str(args.data_workers), "--max-staleness", "1000000", "--rollout-batch-size", "64")  # fmt: skip
        for _ in range(rewards):
            scoring = ["--custom-rm-path", args.custom_rm_path] if args.custom_rm_path else ["--rm-type", "random"]
            add("reward", *scoring, "--num-workers", "1")
        for address in addresses["buffer"] + addresses["reward"]:
            wait_until_serving(address, timeout_s=120)
        target = {kind: "ipv4:" + ",".join(found) for kind, found in addresses.items() if found}
        for _ in range(gateways):
            add("rollout", *common, "--buffer-addr", target["buffer"], "--reward-addr", target["reward"],
                "--rollout-concurrency", str(args.concurrency), "--engine-urls", *engine_urls)  # fmt: skip
        for address in addresses["rollout"]:
            wait_until_serving(address, timeout_s=120)
        with grpc.insecure_channel(addresses["rollout"][0]) as channel:
            rollout_pb2_grpc.RolloutServiceStub(channel).StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)
        time.sleep(args.warm_up)
        pids = {kind: [p.pid for p in found] for kind, found in procs.items()}
        pids |= {"redis": [server.pid_of(ns)], "engines": engine_pids}
        counters, done = dataplane.counters_key(ns), dataplane.waiting_key(ns)
        (before, leased0), rpc0, info0, cpu0, t0 = (
            [int(n or 0) for n in client.hmget(counters, "completed", "leases")],
            rpc_figures(metrics_ports),
            run_node.info(),
            cpu_seconds(pids),
            time.monotonic(),
        )
        threads0 = thread_seconds(pids)
        if args.profile:
            profile({k: v for k, v in pids.items() if k != "redis"}, folder, args.profile, args.seconds / 2)
        time.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
        (after, leased1), rpc1, info1, cpu1, t1 = (
            [int(n or 0) for n in client.hmget(counters, "completed", "leases")],
            rpc_figures(metrics_ports),
            run_node.info(),
            cpu_seconds(pids),
            time.monotonic(),
        )
        threads1 = thread_seconds(pids)
        elapsed, completed = t1 - t0, after - before
        window = [gid.decode() for gid in client.zrangebyscore(done, before + 1, after)]  # completed in the window
        latencies, parts = [], []  # lease → score; (lease → generated, generated → score)
        for gid in window[:: max(1, len(window) // 2000)]:
            t = common_pb2.PromptGroup.FromString(client.get(dataplane.completed_key(ns, gid)) or b"").timings
            if {"leased", "generated", "scored"} <= t.keys():
                latencies.append(t["scored"] - t["leased"])
                parts.append((t["generated"] - t["leased"], t["scored"] - t["generated"]))
        latencies.sort()
        used = {pid: cpu1.get(pid, 0.0) - cpu0.get(pid, 0.0) for pid in cpu1}
        cpu = {kind: sum(used.get(pid, 0.0) for pid in found) for kind, found in pids.items()}
        busiest_pid = max(used, key=used.get)
        moved = sum(info1[k] - info0[k] for k in ("total_net_input_bytes", "total_net_output_bytes"))
        ops = info1["total_commands_processed"] - info0["total_commands_processed"]
        per_group = max(completed, 1)
        return {
            "engines": engines, "buffers": buffers, "rewards": rewards, "gateways": gateways,
            "concurrency": args.concurrency,
            "completed": completed,
            "groups_s": completed / elapsed,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
            "p50_parts_ms": [1000 * statistics.median(p) for p in zip(*parts, strict=True)] or [float("nan")] * 2,
            "redis_ops_s": ops / elapsed,
            "redis_ops_group": ops / per_group,
            "redis_kb_group": moved / per_group / 1024,
            "lease_calls_group": (rpc1["calls"] - rpc0["calls"]) / per_group,
            "groups_lease_call": (leased1 - leased0) / max(rpc1["calls"] - rpc0["calls"], 1),
            "lease_ms": [1000 * (rpc1[s] - rpc0[s]) / max(rpc1[n] - rpc0[n], 1)
                         for s, n in (("waited_s", "waits"), ("served_s", "calls"))],
            "contended_call": (rpc1["contended"] - rpc0["contended"]) / max(rpc1["calls"] - rpc0["calls"], 1),
            "waited_call": (rpc1["waited"] - rpc0["waited"]) / max(rpc1["calls"] - rpc0["calls"], 1),
            "cpu_ms_group": {kind: 1000 * seconds / per_group for kind, seconds in cpu.items()},
            "threads_ms_group": {
                f"{kind}/{name}": round(1000 * (seconds - threads0.get((kind, name), 0.0)) / per_group, 3)
                for (kind, name), seconds in sorted(threads1.items())
            },
            "busiest": (next(k for k, found in pids.items() if busiest_pid in found), used[busiest_pid] / elapsed),
            "folder": str(folder),
        }  # fmt: skip
    finally:  # the gateways first: with the buffers gone first, their leases in flight would fail over and wait
        for kind in ("rollout", "buffer", "reward"):
            for proc in procs[kind]:
                proc.terminate()
            for proc in procs[kind]:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        client.close()
        server.stop()


def problems(rows: list[dict]) -> list[str]:
    """Why the run failed, row by row: a collapse of throughput or a tail that waits on a timer."""
    found = []
    for row in rows:  # against the best row with as many groups in flight a gateway
        best = max(r["groups_s"] / r["gateways"] for r in rows if r["concurrency"] == row["concurrency"])
        name = (f"K={row['engines']} in flight={row['concurrency']} G={row['gateways']} B={row['buffers']} "
                f"R={row['rewards']}")  # fmt: skip
        if not row["completed"]:
            found.append(f"{name}: no group completed in the window")
        elif row["p50_ms"] > 1000:
            found.append(f"{name}: p50 {row['p50_ms']:.0f} ms: with instant engines, a group waited on a timer")
        elif row["p99_ms"] > 100 * row["p50_ms"]:
            found.append(f"{name}: p99 {row['p99_ms']:.0f} ms is over 100 x p50 ({row['p50_ms']:.1f} ms)")
        if row["groups_s"] / row["gateways"] < best / 10:
            found.append(f"{name}: {row['groups_s']:.1f} groups/s, under a tenth of the best row's per gateway")
    return found


def log_tails(folder: Path, lines: int = 30) -> str:
    tails = []
    for log in sorted(folder.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(tails)


def table(rows: list[dict]) -> None:
    print("| K | in flight | G | B | R | groups/s | of linear | p50 ms | p50 ms: generate / score | p99 ms "
          "| Redis ops/s | Redis ops / KB a group "
          "| LeasePrompts calls a group / groups a call | lease ms: gateway / buffer | waited / contended a call "
          "| CPU ms a group: gateways / buffers / rewards / Redis / engines | busiest process (cores) |")  # fmt: skip
    print("|---" * 17 + "|")
    for row in rows:
        same = [r for r in rows if all(r[k] == row[k] for k in ("engines", "concurrency", "buffers", "rewards"))]
        base = min(same, key=lambda r: r["gateways"])
        share = row["groups_s"] / (base["groups_s"] / base["gateways"] * row["gateways"]) if base["groups_s"] else 0
        cpu = " / ".join(f"{row['cpu_ms_group'][kind]:.2f}" for kind in KINDS)
        kind, cores = row["busiest"]
        print(f"| {row['engines']} | {row['concurrency']} | {row['gateways']} | {row['buffers']} | {row['rewards']} "
              f"| {row['groups_s']:.0f} "
              f"| {share:.0%} | {row['p50_ms']:.1f} | {row['p50_parts_ms'][0]:.1f} / {row['p50_parts_ms'][1]:.1f} "
              f"| {row['p99_ms']:.1f} | {row['redis_ops_s']:.0f} "
              f"| {row['redis_ops_group']:.0f} / {row['redis_kb_group']:.1f} "
              f"| {row['lease_calls_group']:.2f} / {row['groups_lease_call']:.1f} "
              f"| {row['lease_ms'][0]:.1f} / {row['lease_ms'][1]:.1f} "
              f"| {row['waited_call']:.2f} / {row['contended_call']:.2f} | {cpu} "
              f"| {kind} ({cores:.2f}) |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[64])
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--buffers", type=int, nargs="+", default=[2])
    parser.add_argument("--rewards", type=int, nargs="+", default=[2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64], help="groups in flight per gateway")
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--redis-cluster", type=int, default=0, metavar="NODES",
                        help="run on a Redis Cluster of this many nodes (the run's keys on one of them)")  # fmt: skip
    parser.add_argument("--warm-up", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--engine-processes", type=int, default=max(1, (os.cpu_count() or 1) // 8),
                        help="processes serving the instant engines (one would be the bottleneck)")  # fmt: skip
    parser.add_argument(
        "--data-workers",
        type=int,
        default=1,
        help="each buffer's tokenizing processes (--num-data-workers; 0: a thread of the buffer)",
    )
    parser.add_argument("--custom-rm-path", help="score with this reward function (module.function) instead of "
                        "the built-in random one")  # fmt: skip
    parser.add_argument("--log-level", default="info", help="the services' (their logs are in --folder)")
    parser.add_argument("--folder", type=Path, help="where the services' logs go (default: a new temporary folder)")
    parser.add_argument("--profile", metavar="PATH", nargs="?", const="py-spy",
                        help="sample every service with py-spy (at PATH) over half the window")  # fmt: skip
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="slipstream-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(folder / "model")
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(args.prompts)))
    rows = []
    for engines in args.engines:
        urls, processes = start_instant_engines(engines, args.engine_processes)
        try:
            for concurrency, buffers, rewards, gateways in itertools.product(
                args.concurrency, args.buffers, args.rewards, args.gateways
            ):
                where = folder / f"K{engines}-C{concurrency}-B{buffers}-R{rewards}-G{gateways}"
                row_args = argparse.Namespace(**vars(args) | {"concurrency": concurrency})
                rows.append(measure(row_args, engines, buffers, rewards, gateways, where, model, data, urls,
                                    [p.pid for p in processes]))  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for process in processes:
                process.terminate()
    redis_kind = f"Redis Cluster of {args.redis_cluster} nodes" if args.redis_cluster else "Redis"
    cluster_flag = f" --redis-cluster {args.redis_cluster}" if args.redis_cluster else ""
    print(f"\nInstant engines (benchmark-only fixture, {args.engine_processes} processes), every replica on one "
          f"{redis_kind}, \"in flight\" the groups in flight per gateway, 1 sample a group; {os.cpu_count()} CPU "
          f"cores; {time.strftime('%Y-%m-%d')}")  # fmt: skip
    table(rows)
    join = lambda values: " ".join(map(str, values))  # noqa: E731
    print(f"\nReproduce: .venv/bin/python bench/scale.py --engines {join(args.engines)} --gateways "
          f"{join(args.gateways)} --buffers {join(args.buffers)} --rewards {join(args.rewards)} --concurrency "
          f"{join(args.concurrency)} --engine-processes {args.engine_processes} --data-workers {args.data_workers} "
          f"--warm-up {args.warm_up:g} "
          f"--seconds {args.seconds:g}{cluster_flag}")  # fmt: skip
    found = problems(rows)
    if found:
        print("\nFAILED:\n" + "\n".join(found), file=sys.stderr)
        for row in rows:
            print(f"\nLogs of {row['folder']}:\n{log_tails(Path(row['folder']))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
