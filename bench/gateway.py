"""The rollout gateway's own ceiling: its engine pool routing /generate requests to engines that answer instantly.

The instant engines are a benchmark-only fixture (below): a bare asyncio HTTP server in another process that answers
every SGLang route with a fixed reply, so the figures measure the gateway, not a model. 64 requests are kept in
flight across 8 engines; "direct" sends the same requests from the same HTTP client straight to the engines, so
the difference is what the pool adds (picking an engine, per-engine limits, bookkeeping, retries). The two paths
take turns in 5 rounds.

Run: .venv/bin/python bench/gateway.py [--engines 8] [--concurrency 64] [--requests 20000]
"""

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time

import aiohttp
import uvloop

from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool

REPLY = {
    "text": "42",
    "output_ids": [19, 17],
    "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                  "weight_version": "default", "completion_tokens": 2,
                  "output_token_logprobs": [[-0.1, 19, None], [-0.2, 17, None]]},
}  # fmt: skip
ROUNDS = 5
INFO = {"tp_size": 1, "version": "0.5.23", "weight_version": "default", "model_path": "instant"}


async def _instant_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Benchmark-only: answers HTTP/1.1 keep-alive requests at once, with no model behind them."""
    generate, info = json.dumps(REPLY).encode(), json.dumps(INFO).encode()
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            body = generate if head.startswith(b"POST /generate") else info
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _serve_instant_engines(count: int, ports) -> None:
    """Benchmark-only: `count` instant engines on ports the system picks, sent back through `ports` (a Connection)."""

    async def main() -> None:
        servers = [await asyncio.start_server(_instant_engine, "127.0.0.1", 0) for _ in range(count)]
        ports.send([server.sockets[0].getsockname()[1] for server in servers])
        await asyncio.gather(*(server.serve_forever() for server in servers))

    asyncio.run(main())


def start_instant_engines(count: int, processes: int = 1) -> tuple[list[str], list[multiprocessing.Process]]:
    """Benchmark-only: `count` instant engines spread over `processes` processes; their URLs and the processes."""
    urls, procs = [], []
    for index in range(processes):
        receive, send = multiprocessing.Pipe(duplex=False)
        share = count // processes + (index < count % processes)
        proc = multiprocessing.Process(target=_serve_instant_engines, args=(share, send), daemon=True)
        proc.start()
        procs.append(proc)
        if not receive.poll(60):
            raise RuntimeError(f"the instant engines did not start (exit code {proc.exitcode})")
        urls += [f"http://127.0.0.1:{port}" for port in receive.recv()]
    return urls, procs


async def _drive(send, concurrency: int, total: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            await send()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


async def run(urls: list[str], concurrency: int, total: int) -> list[tuple[str, float, list[float]]]:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    pool = EnginePool(RolloutConfig(engine_urls=urls))
    for url in urls:
        await pool.register(url)
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # the pool's client, used directly
    turn = iter(range(10**9))

    async def direct() -> None:
        async with client.post(f"{urls[next(turn) % len(urls)]}/generate", json=body) as response:
            await response.json()

    async def through_pool() -> None:
        await pool.generate(body, affinity=None)

    paths = (("direct to the engines", direct), ("through the gateway's pool", through_pool))
    for _, send in paths:
        await _drive(send, concurrency, min(total, 2000))  # warm connections
    # The two paths take turns, ROUNDS times, so that both see the same machine (a 2-core one drifts with whatever
    # else runs): each path's figures are over all its rounds.
    times = {name: [0.0, []] for name, _ in paths}
    for _ in range(ROUNDS):
        for name, send in paths:
            elapsed, latencies = await _drive(send, concurrency, total // ROUNDS)
            times[name][0] += elapsed
            times[name][1] += latencies
    rows = [(name, (total // ROUNDS) * ROUNDS / elapsed, latencies) for name, (elapsed, latencies) in times.items()]
    await client.close()
    await pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    urls, engines = start_instant_engines(args.engines)
    try:
        rows = uvloop.run(run(urls, args.concurrency, args.requests))  # the gateway's loop
    finally:
        engines[0].terminate()
    direct_p50 = statistics.median(rows[0][2])
    direct_p99 = sorted(rows[0][2])[int(0.99 * len(rows[0][2]))]
    print(f"{args.engines} instant engines (benchmark-only fixture), {args.concurrency} requests in flight, "
          f"{args.requests} requests; 2-core machine")  # fmt: skip
    print("path | requests/s | latency p50 ms | latency p99 ms | added p50 ms | added p99 ms")
    print("--- | --- | --- | --- | --- | ---")
    for name, rate, latencies in rows:
        p50, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * len(latencies))]
        print(f"{name} | {rate:.0f} | {p50 * 1000:.2f} | {p99 * 1000:.2f} | {(p50 - direct_p50) * 1000:.2f} | "
              f"{(p99 - direct_p99) * 1000:.2f}")  # fmt: skip
    print(f"\nReproduce: .venv/bin/python bench/gateway.py --engines {args.engines} --concurrency {args.concurrency} "
          f"--requests {args.requests}")  # fmt: skip


if __name__ == "__main__":
    main()
