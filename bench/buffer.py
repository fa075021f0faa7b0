"""Submit + batch throughput of the buffer service against raw Redis moving the same bytes.

For groups of 8 samples of 1k and 8k tokens: rollout workers hand in every group as a gateway does, then the trainer
takes them back in batches (GetBatch + CommitBatch) from a real `slipstream buffer` process and puts each group
together. Three paths: `buffer`, the data plane of a gateway and a trainer with --redis-url when the buffer runs no
dynamic-sampling filter: the worker completes each group in Redis itself (its arrays and the buffer's submit script,
pipelined), the trainer gets the groups without their arrays and the arrays' keys over gRPC and reads the arrays from
Redis; `upload`, the same with a dynamic-sampling filter in the buffer: the worker uploads the arrays and sends the
rest in SubmitGroup; and `inline`, everything through the buffer. The worker runs on the gateway's event loop
(uvloop) with its clients connected before the clock starts, as a running gateway's are, and what setup made is out
of the garbage collector's reach (gc.freeze), as a started service's is; each group is checked whole after the clock
stops. The baseline is redis-py storing and reading the same serialized groups with pipelined SET and GET on the same
Redis. Each run starts on a freshly rewritten AOF (so that none of Redis's own rewrites, a fork each, falls in a timed
run at random), and a warm-up run of each path comes before the counted ones.

Run: .venv/bin/python bench/buffer.py [--groups 64] [--batch 16] [--tokens 1024 8192]
"""

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis
import redis.asyncio
import uvloop
from redis.connection import Encoder, PythonRespSerializer

from services.buffer.dataplane import UPLOAD_TTL_S, DataPlane, complete_in_redis
from services.common.clients import channel_options, wait_until_serving
from services.common.redis_connection import EmbeddedRedis
from services.train.tiny_checkpoint import write_tokenizer
from slipstream.samples import decode_tokens, encode_logprobs, encode_mask, encode_tokens, put_batch_arrays, take_arrays
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2

SUBMITTING = 8  # groups a gateway submits at once
PATHS = ("buffer", "upload", "inline")
READ_SIZE = 1 << 20  # the trainer reads values of megabytes (services/trainer/assembly.py, data_plane)


def make_group(lease: buffer_pb2.Lease, samples: int, tokens: int, rng: np.random.Generator) -> common_pb2.PromptGroup:
    group = common_pb2.PromptGroup()
    group.CopyFrom(lease.group)
    prompt = decode_tokens(group.prompt_tokens)
    response = tokens - len(prompt)
    for i in range(samples):
        response_ids = rng.integers(0, 150_000, response, dtype=np.int32)
        group.samples.append(
            common_pb2.Sample(
                sample_id=f"{group.group_id}/{i}",
                index=i,
                tokens=encode_tokens(np.concatenate([prompt, response_ids])),
                prompt_length=len(prompt),
                response_length=response,
                loss_mask=encode_mask(np.ones(response)),
                rollout_logprobs=encode_logprobs(-5 * rng.random(response)),
                reward=float(i % 2),
                status=common_pb2.SAMPLE_STATUS_COMPLETED,
                weight_versions=[common_pb2.WeightVersionSpan(version="0", start=0, end=response)],
            )
        )
    return group


def redis_client(url: str) -> redis.Redis:
    """redis-py with its Python command packer, as the gateway's asyncio client packs: it sends a value of megabytes
    as it is, where the hiredis packer (the sync client's default) copies it first (≈ 1 ms per 0.56 MiB here)."""
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis.from_url(url, command_packer=packer, socket_read_size=READ_SIZE)


async def submit_all(address: str, url: str, leases: list, groups: list, path: str) -> float:
    """Rollout workers handing in every group as the gateway does (services/rollout/workers.py, Rollout._submit):
    asyncio, several groups finishing at once. Returns the seconds taken, clients connected beforehand."""
    client = redis.asyncio.Redis.from_url(url)
    await asyncio.gather(*(client.ping() for _ in range(SUBMITTING)))  # a running gateway's pool is connected
    store = DataPlane(client, leases[0].submit_namespace)
    slots = asyncio.Semaphore(SUBMITTING)

    async def submit(lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> bool:
        async with slots:
            if path == "buffer":
                return await complete_in_redis(store, lease, group)
            request = buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=group)
            if path == "upload":
                await client.set(lease.upload_key, take_arrays(request.group), ex=UPLOAD_TTL_S)
                request.arrays_in_redis = True
            return (await stub.SubmitGroup(request, timeout=60)).accepted

    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.GetState(buffer_pb2.GetStateRequest(), timeout=60)  # connected
        start = time.perf_counter()
        assert all(await asyncio.gather(*map(submit, leases, groups)))
        elapsed = time.perf_counter() - start
    await client.aclose()
    return elapsed


def fresh_aof(url: str) -> None:
    """Rewrites the AOF now and waits for it: Redis rewrites it on its own each time it has grown by 64 MB (a fork
    of redis-server, then copy-on-write while the child writes), which would fall in a timed run at random (either
    path, both write the same bytes). Each run starts on a rewritten AOF and writes less than 64 MB in it."""
    client = redis.Redis.from_url(url)
    client.bgrewriteaof()  # scheduled after one in progress
    while (info := client.info("persistence"))["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]:
        time.sleep(0.01)
    client.close()
    os.sync()


def raw_redis(url: str, payloads: list[bytes], batch: int) -> float:
    client = redis_client(url)
    client.flushdb()
    fresh_aof(url)
    start = time.perf_counter()
    for i in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for j, payload in enumerate(payloads[i : i + batch]):
            pipe.set(f"raw:{i + j}", payload)
        pipe.execute()
    for i in range(0, len(payloads), batch):
        pipe = client.pipeline(transaction=False)
        for j in range(i, min(i + batch, len(payloads))):
            pipe.get(f"raw:{j}")
        assert all(pipe.execute())
    elapsed = time.perf_counter() - start
    client.flushdb()
    client.close()
    return elapsed


def buffer_service(
    url: str, folder: Path, run: str, groups: int, batch: int, samples: int, tokens: int, path: str
) -> tuple[float, list]:
    data = folder / f"prompts-{tokens}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?"}) + "\n" for i in range(groups)))
    port = 50200 + tokens % 97
    args = [sys.executable, "-m", "services", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--redis-url", url, "--run-id", run, "--prompt-data", str(data)]
    args += ["--hf-checkpoint", str(folder / "tokenizer"), "--num-data-workers", "0", "--metrics-port", "null"]
    args += ["--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(samples), "--max-staleness", "1000"]
    if path == "upload":  # a filter that keeps every group: the buffer must see each group, so it is submitted to it
        args += ["--dynamic-sampling-filter-path", "services.buffer.filters:check_reward_nonzero_std"]
    server = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    reader = redis.Redis.from_url(url, socket_read_size=READ_SIZE)  # the trainer's client
    reader.ping()
    try:
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, 60)
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            leases = stub.LeasePrompts(buffer_pb2.LeasePromptsRequest(max_groups=groups), timeout=60).leases
            assert len(leases) == groups and all(bool(lease.submit_namespace) == (path != "upload") for lease in leases)
            rng = np.random.default_rng(0)
            made = [make_group(lease, samples, tokens, rng) for lease in leases]
            payloads = [group.SerializeToString() for group in made]
            fresh_aof(url)
            elapsed = uvloop.run(submit_all(address, url, leases, made, path))  # the gateway's loop
            start, batches = time.perf_counter(), []
            for step in range(groups // batch):  # as the trainer does it (services/trainer/loop.py, _get_batch)
                ask = buffer_pb2.GetBatchRequest(step=step, dp_size=1, timeout_seconds=30,
                                                 arrays_from_redis=path != "inline")  # fmt: skip
                got = stub.GetBatch(ask, timeout=60)
                arrays = [reader.get(key) for key in got.arrays_keys] if got.arrays_keys else got.arrays
                put_batch_arrays(got.groups, arrays)
                batches.append(got.groups)
                stub.CommitBatch(buffer_pb2.CommitBatchRequest(step=step), timeout=60)
            elapsed += time.perf_counter() - start
            trained = {g.group_id: g for groups in batches for g in groups}
            for sent in map(common_pb2.PromptGroup.FromString, payloads):  # every group trained, with its arrays
                assert [s.SerializeToString() for s in trained[sent.group_id].samples] == [
                    s.SerializeToString() for s in sent.samples
                ]
        return elapsed, payloads
    finally:
        reader.close()
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the table shows the medians")
    parser.add_argument("--warmup", type=int, default=1, help="runs per size before those, not counted: the first "
                        "run of a process pays for growing its heap and its clients' first use")  # fmt: skip
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tokenizer(folder / "tokenizer")
        redis_server = EmbeddedRedis(folder / "redis").start()
        gc.freeze()  # as a started service does (services/common/server.py)
        try:
            for tokens in args.tokens:
                shape = (args.groups, args.batch, args.samples, tokens)
                times: dict[str, list[float]] = {path: [] for path in (*PATHS, "raw")}
                for i in range(-args.warmup, args.repeat):  # the warm-up runs are not counted
                    for path in PATHS:
                        elapsed, payloads = buffer_service(redis_server.url, folder, f"b{tokens}-{i}-{path}", *shape,
                                                           path=path)  # fmt: skip
                        times[path].append(elapsed)
                    times["raw"].append(raw_redis(redis_server.url, payloads, args.batch))
                times = {name: t[args.warmup :] for name, t in times.items()}
                median = {name: statistics.median(t) for name, t in times.items()}
                ratios = [raw / buf for raw, buf in zip(times["raw"], times["buffer"], strict=True)]
                mb, n = sum(map(len, payloads)) / 2**20, args.groups
                rows.append((tokens, mb / n, n / median["buffer"], mb / median["buffer"], n / median["upload"],
                             n / median["inline"], n / median["raw"], mb / median["raw"], statistics.median(ratios),
                             ratios))  # fmt: skip
        finally:
            redis_server.stop()
    print(
        f"groups of {args.samples} samples, {args.groups} groups, batches of {args.batch}, median of {args.repeat} runs"
    )
    header = ["tokens/sample", "MiB/group", "buffer groups/s", "buffer MiB/s", "upload groups/s", "inline groups/s"]
    header += ["raw groups/s", "raw MiB/s", "buffer/raw (median)", "buffer/raw per run"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for tokens, size, g_buf, mb_buf, g_upload, g_inline, g_raw, mb_raw, ratio, ratios in rows:
        runs = " ".join(f"{r:.0%}" for r in ratios)
        print(f"{tokens} | {size:.2f} | {g_buf:.1f} | {mb_buf:.1f} | {g_upload:.1f} | {g_inline:.1f} | {g_raw:.1f} | "
              f"{mb_raw:.1f} | {ratio:.0%} | {runs}")  # fmt: skip
    tokens = " ".join(map(str, args.tokens))
    command = f".venv/bin/python bench/buffer.py --groups {args.groups} --batch {args.batch} --tokens {tokens}"
    command += f" --repeat {args.repeat}" + (f" --warmup {args.warmup}" if args.warmup != 1 else "")
    print(f"\nReproduce: {command}")


if __name__ == "__main__":
    main()
