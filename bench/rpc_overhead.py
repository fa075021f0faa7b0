"""Round-trip cost of the shared plumbing: a unary gRPC call through the service interceptor, and a Redis PING.

Every later figure (lease, submit, batch latency) sits on top of these. Prints a table and the command to reproduce it.
Run: .venv/bin/python bench/rpc_overhead.py [--calls 2000]
"""

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import redis

from services.common.clients import open_channel
from services.common.config import ServiceConfig
from services.common.redis_connection import EmbeddedRedis
from services.common.server import GrpcServer, Service, Servicer
from slipstream.v1 import trainer_pb2, trainer_pb2_grpc


class EchoTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    async def GetStatus(self, request, context):
        return trainer_pb2.TrainerStatus(step=1)


def percentiles(samples_s: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered) * 1e6, p99 * 1e6, len(ordered) / sum(ordered)


def time_calls(call, calls: int) -> list[float]:
    for _ in range(min(100, calls)):  # warm up connections and code paths
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    rows = []
    # Redis first: starting its process while gRPC threads run makes gRPC warn about fork().
    with tempfile.TemporaryDirectory() as folder:
        redis_server = EmbeddedRedis(Path(folder)).start()
        client = redis.Redis(unix_socket_path=str(redis_server.socket_path))
        rows.append(("Redis PING (embedded, unix socket)", time_calls(client.ping, args.calls)))
        client.close()
        redis_server.stop()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = ServiceConfig(host="127.0.0.1", port=0, metrics_port=None)
    server = GrpcServer(Service("bench", config, [Servicer.of(EchoTrainer())]))
    port = asyncio.run_coroutine_threadsafe(server.start(), loop).result()
    with open_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        rows.append(
            (
                "gRPC unary, channel with retry policy",
                time_calls(lambda: stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5), args.calls),
            )
        )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        rows.append(
            (
                "gRPC unary, plain channel",
                time_calls(lambda: stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5), args.calls),
            )
        )
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result()

    print(f"{'path':<42} {'p50 µs':>9} {'p99 µs':>9} {'calls/s':>9}")
    for name, samples in rows:
        p50, p99, rate = percentiles(samples)
        print(f"{name:<42} {p50:>9.0f} {p99:>9.0f} {rate:>9.0f}")
    print(f"\n{args.calls} sequential calls each, one client thread.")
    print(f"Reproduce: .venv/bin/python bench/rpc_overhead.py --calls {args.calls}")


if __name__ == "__main__":
    main()
