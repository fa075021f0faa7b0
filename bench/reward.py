"""Math reward throughput through the reward service against math-verify called in-process on the same items.

The service runs as its own process (`slipstream reward`, its default worker count); a client sends Score requests
of --batch items. The baseline parses and verifies the same (label, response) pairs with math-verify in this
process, one after another.

Run: .venv/bin/python bench/reward.py [--batch 256] [--batches 4]
"""

import argparse
import os
import random
import subprocess
import sys
import time

import grpc

from services.common.clients import channel_options, wait_until_serving
from services.common.processes import free_port
from slipstream.v1 import reward_pb2, reward_pb2_grpc


def make_items(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(response, label) pairs in the forms math answers come in: integers, fractions, decimals, equations,
    expressions with roots, some wrong."""
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        a, b = rng.randint(1, 40), rng.randint(2, 12)
        kind = i % 5
        if kind == 0:
            label, answer = str(a * b), str(a * b + (i % 3 == 0))
        elif kind == 1:
            label, answer = f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{2 * a}}}{{{2 * b}}}"
        elif kind == 2:
            label, answer = str(a / 4), f"\\frac{{{a}}}{{4}}"
        elif kind == 3:
            label, answer = str(a), f"x = {a}"
        else:
            label, answer = f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}"
        reasoning = f"We compute step by step: {a} and {b} give the result. " * 3
        pairs.append((f"{reasoning}The final answer is $\\boxed{{{answer}}}$.", label))
    return pairs


def in_process(pairs: list[tuple[str, str]]) -> tuple[float, list[float]]:
    from math_verify import parse, verify

    start = time.perf_counter()
    rewards = [float(verify(parse(f"${label}$"), parse(response))) for response, label in pairs]
    return time.perf_counter() - start, rewards


def through_service(pairs: list[tuple[str, str]], batch: int) -> tuple[float, list[float]]:
    port = free_port()
    cmd = [sys.executable, "-m", "services", "reward", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen([*cmd, "--metrics-port", "null", "--rm-type", "math"], stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, 60)
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            requests = [
                reward_pb2.ScoreRequest(
                    items=[reward_pb2.RewardItem(response=r.encode(), label=label) for r, label in pairs[i : i + batch]]
                )
                for i in range(0, len(pairs), batch)
            ]
            stub.Score(requests[0], timeout=600)  # warm the workers (imports), as a running service would be
            start = time.perf_counter()
            rewards = [result.reward for request in requests for result in stub.Score(request, timeout=600).results]
            return time.perf_counter() - start, rewards
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    pairs = make_items(args.batch * args.batches)
    t_service, service_rewards = through_service(pairs, args.batch)
    t_local, local_rewards = in_process(pairs)
    agree = sum(a == b for a, b in zip(service_rewards, local_rewards, strict=True)) / len(pairs)
    n = len(pairs)
    print(f"math rewards, {n} items in Score requests of {args.batch}; {os.cpu_count()} cores")
    print("path | items/s | ms/item")
    print("--- | --- | ---")
    print(f"reward service | {n / t_service:.0f} | {1000 * t_service / n:.2f}")
    print(f"math-verify in-process | {n / t_local:.0f} | {1000 * t_local / n:.2f}")
    print(f"\nservice / in-process: {t_local / t_service:.2f} (goal >= 0.8); rewards agree on {agree:.0%} of items")
    print(f"Reproduce: .venv/bin/python bench/reward.py --batch {args.batch} --batches {args.batches}")


if __name__ == "__main__":
    main()
