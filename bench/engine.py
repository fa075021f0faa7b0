"""Throughput of the reference engine on rollout workloads, in-process and through its HTTP API, against the
workload's physical limit.

Workloads (each run twice to warm up, which grows the KV cache, compiles the kernels and captures the CUDA graph of
every batch size it meets, at a size's second use; then timed):
- `nanovllm`: nano-vllm's benchmark. 256 prompts of random token ids, input and output lengths uniform in
  [100, 1024], seed 0, EOS ignored; on Qwen3-0.6B's full shape (151,936 words) with random weights by default.
- `grpo`: an RL step's rollout. 64 prompts (random ids, 64-256 tokens, seed 0) x 8 samples (one request with n = 8),
  512 new tokens each at temperature 1, EOS ignored; on `--model` (the real model: SmolLM2-135M-Instruct converted
  from the packaged GGUF).
- `concurrency`: c requests at once for each c of `--concurrency`, `--max-new-tokens` each at temperature 1.

The physical limit: every decode step must read the weights and each running sequence's keys and values once; the
sum of those bytes over the workload's steps (all sequences running from the start), at `--bandwidth-tbs` (an H200's
4.8 TB/s by default), is the least time the workload can take. Prefill and sampling are left out of the bound.

Run (one H200):  python bench/engine.py --device cuda --workload nanovllm
                 python bench/engine.py --device cuda --workload grpo --model /tmp/model
                 python bench/engine.py --device cuda --workload concurrency --model /tmp/model
Run (CPU):       .venv/bin/python bench/engine.py --workload concurrency --concurrency 1 8 --max-new-tokens 16
"""

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import torch

from services.common.processes import free_port
from services.engine.batch import Sequence
from services.engine.config import EngineConfig
from services.engine.sampling import SamplingParams
from services.engine.server import load
from services.train.tiny_checkpoint import QWEN3_0_6B, write_tiny_model


@dataclass
class Request:
    prompt: list[int]
    new_tokens: int
    temperature: float
    n: int = 1


def nanovllm(vocab: int) -> list[Request]:
    rng = random.Random(0)
    requests = []
    for _ in range(256):
        prompt = [rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(100, 1024))]
        requests.append(Request(prompt, rng.randint(100, 1024), 0.6))  # nano-vllm's temperature
    return requests


def grpo(vocab: int) -> list[Request]:
    rng = random.Random(0)
    return [Request([rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(64, 256))], 512, 1.0, 8)
            for _ in range(64)]  # fmt: skip


def concurrency(vocab: int, count: int, new_tokens: int) -> list[Request]:
    rng = random.Random(count)
    return [Request([rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(32, 96))], new_tokens, 1.0)
            for _ in range(count)]  # fmt: skip


def in_process(engine, requests: list[Request]) -> float:
    """Seconds for every request's sequences, submitted at once, to finish."""
    total = sum(r.n for r in requests)
    done, finished = threading.Event(), []

    def listener(seq, last: bool) -> None:
        if last:
            finished.append(seq)
            if len(finished) == total:
                done.set()

    started = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(max_new_tokens=r.new_tokens, temperature=r.temperature, ignore_eos=True)
        for j in range(r.n):
            engine.submit(Sequence(rid=f"{i}-{j}", prompt_ids=r.prompt, params=params), listener)
    done.wait()
    return time.perf_counter() - started


async def over_http(url: str, requests: list[Request]) -> float:
    """Seconds for every request, posted at once, to be answered. The client is aiohttp, as SGLang's
    bench_serving's: httpx's own work took 2.4 x the engine's time for 256 short requests on the 2-core machine."""

    async def post(session: aiohttp.ClientSession, r: Request) -> None:
        sampling = {"max_new_tokens": r.new_tokens, "temperature": r.temperature, "ignore_eos": True, "n": r.n}
        async with session.post(f"{url}/generate", json={"input_ids": r.prompt, "sampling_params": sampling}) as reply:
            reply.raise_for_status()
            await reply.read()

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(post(session, r) for r in requests))
        return time.perf_counter() - started


def start_engine(config: EngineConfig) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "services", "engine", "--model-path", config.model_path, "--port", str(port),
           "--device", config.device, "--max-running-requests", str(config.max_running_requests)]  # fmt: skip
    cmd += ["--enable-torch-compile"] if config.enable_torch_compile else []
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=60).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the engine did not become healthy")


def server_states(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]


def limit_seconds(model, requests: list[Request], bandwidth: float) -> float:
    """The least time the decode steps take at `bandwidth` bytes/s: weights and every running sequence's cache
    read once a step."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    sequences = [(len(r.prompt), r.new_tokens) for r in requests for _ in range(r.n)]
    seconds = 0.0
    for step in range(max(new for _, new in sequences)):
        context = sum(prompt + step for prompt, new in sequences if new > step)
        seconds += (weights + context * per_token) / bandwidth
    return seconds


def breakdown(engine) -> dict[str, float]:
    """Adds up the engine thread's seconds in each phase of a step, and those it waits for the GPU (reading a queued
    step's tokens), without synchronizing: the overlap of the two stays as it runs. Little waiting means the thread
    is what bounds the steps (benchmark-only instrumentation)."""
    import collections

    from services.engine import core

    totals: dict[str, float] = collections.defaultdict(int)

    def wrap(owner, name: str, label: str | None = None) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            totals[label or name] += time.perf_counter() - started
            totals[f"{label or name} calls"] += 1
            return result

        setattr(owner, name, timed)

    for owner, name in [(engine.batcher, "_replay"), (engine.batcher, "_eager")]:
        wrap(owner, name)
    if engine.batcher.graphs is not None:
        wrap(engine.batcher.graphs, "run", "graph launch")  # inside _replay
    for name in ("_choose", "_read", "_step", "_admit"):
        wrap(engine, name)
    if engine.device.type == "cuda":
        waits = type("Waited", (torch.cuda.Event,), {})  # the queued steps' events: waiting for the GPU
        wrap(waits, "synchronize", "waiting for the GPU")
        core.torch.cuda.Event = waits  # the process's torch.cuda.Event: this process only benchmarks
    return totals


@contextlib.contextmanager
def sync_debug(on: bool):
    """Reports each place that makes the host wait for the GPU (torch.cuda.set_sync_debug_mode), once, with its stack:
    such a wait in the engine thread's step undoes the overlap of the thread and the GPU (benchmark-only)."""
    if not on or not torch.cuda.is_available():
        yield
        return
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        if (filename, lineno, stack) not in seen:
            seen.add((filename, lineno, stack))
            print(f"a synchronizing call: {message}\n{stack}", file=sys.stderr)

    previous = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
        print(f"{len(seen)} synchronizing places in the timed run", file=sys.stderr)


def profile(engine, requests: list[Request], steps: int) -> None:
    """Runs the workload once more and records the GPU's kernels over `steps` decode steps from a quarter of the way
    in (torch.profiler, benchmark-only): prints the GPU's busy time a step and the kernels that take most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as record

    runner = threading.Thread(target=in_process, args=(engine, requests))
    count = lambda: sum(engine.batch_sizes.values())  # noqa: E731
    start = count() + sum(r.new_tokens for r in requests) // len(requests) // 4
    runner.start()
    while count() < start:
        time.sleep(0.001)
    with record(activities=[ProfilerActivity.CUDA]) as prof:
        first, began = count(), time.perf_counter()
        while count() < first + steps and runner.is_alive():
            time.sleep(0.001)
        done, wall = count() - first, time.perf_counter() - began
    runner.join()
    if not done:
        print("profile: the run ended before the window began")
        return
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.device_time_total for e in kernels) / done / 1000
    print(f"profile: {done} steps, {1000 * wall / done:.2f} ms a step, the GPU busy {busy:.2f} ms a step")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:15]:
        print(f"  {e.device_time_total / done / 1000:7.3f} ms {e.count / done:6.1f} calls  {e.key[:100]}")


def profile_eager(engine, calls: int):
    """Records the engine thread's next `calls` eager steps (prefill chunks) under torch.profiler, CPU and CUDA, and
    prints the calls that took the thread's time (benchmark-only). Returns a switch: on() starts the count."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as record

    inner, left = engine.batcher._eager, [0]

    def recorded(*args, **kwargs):
        if left[0] <= 0:
            return inner(*args, **kwargs)
        left[0] -= 1
        started = time.perf_counter()
        with record(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = inner(*args, **kwargs)
        print(f"an eager step of {sum(s.cached for s in result[0])} cached positions: "
              f"{1000 * (time.perf_counter() - started):.1f} ms recorded")  # fmt: skip
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        return result

    engine.batcher._eager = recorded
    return lambda: left.__setitem__(0, calls)


def random_model(path: Path, device: str) -> Path:
    """Qwen3-0.6B's shape with its 151,936 words, random weights (on the CPU, a tiny model); the tokenizer is the
    test one (it decodes ids past its own words as nothing)."""
    if device == "cpu":
        return write_tiny_model(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_tiny_model(path, dtype="bfloat16", **QWEN3_0_6B)
    config = AutoConfig.from_pretrained(path)
    config.vocab_size = 151936
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="concurrency", choices=["nanovllm", "grpo", "concurrency"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", type=Path, help="an HF checkpoint folder (default: Qwen3-0.6B's shape, random)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the concurrency workload's")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="the device's memory bandwidth")
    parser.add_argument("--enable-torch-compile", action="store_true", help="the engine's option: compiled layers")
    parser.add_argument("--sync-debug", action="store_true", help="report each call that waits for the GPU in the "
                        "timed in-process run, with its stack (CUDA)")  # fmt: skip
    parser.add_argument("--no-http", action="store_true", help="in-process only")
    parser.add_argument("--breakdown", action="store_true", help="the engine thread's seconds in each phase of a step "
                        "and waiting for the GPU")  # fmt: skip
    parser.add_argument("--profile-eager", type=int, default=0, metavar="CALLS", help="the first CALLS eager "
                        "steps (prefill) of the timed run under torch.profiler")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS", help="after the timed run, the GPU's "
                        "kernels over STEPS decode steps of another run (CUDA)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_model(Path(tmp) / "model", args.device)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        if args.workload == "concurrency":
            workloads = [(f"c={c}", concurrency(vocab, c, args.max_new_tokens)) for c in args.concurrency]
        else:
            workloads = [(args.workload, {"nanovllm": nanovllm, "grpo": grpo}[args.workload](vocab))]
        rows = max(sum(r.n for r in requests) for _, requests in workloads)
        config = EngineConfig(model_path=str(path), device=args.device, max_running_requests=rows,
                              enable_torch_compile=args.enable_torch_compile)  # fmt: skip
        engine = load(config)
        totals = breakdown(engine) if args.breakdown else None
        start_eager_profile = profile_eager(engine, args.profile_eager) if args.profile_eager else lambda: None
        results = []
        for name, requests in workloads:
            tokens = sum(r.new_tokens * r.n for r in requests)
            for _ in range(2):  # warm-up: the cache grown, the graphs captured
                in_process(engine, requests)
            if totals is not None:
                totals.clear()
            steps_before = sum(engine.batch_sizes.values())
            eager_before, eager_s_before = engine.batcher.eager_steps, engine.batcher.eager_seconds
            start_eager_profile()
            with sync_debug(args.sync_debug):
                seconds = in_process(engine, requests)
            steps = sum(engine.batch_sizes.values()) - steps_before
            print(
                f"{name} in-process: {steps} decode steps, of them {engine.batcher.eager_steps - eager_before} eager "
                f"({1000 * (engine.batcher.eager_seconds - eager_s_before):.0f} ms on the engine thread)"
            )
            limit = limit_seconds(engine.model, requests, args.bandwidth_tbs * 1e12)
            results.append([name, tokens, tokens / seconds, 1000 * seconds / steps, tokens / limit, limit / seconds])
            if args.profile and args.device == "cuda":
                profile(engine, requests, args.profile)
        graphs = engine.batcher.graphs
        print("decode: " + (f"CUDA graphs, {graphs.captures} captured" if graphs and not graphs.failed else "eager"))
        if totals is not None:
            print("the last timed run: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in totals.items()))  # fmt: skip
            if totals["_step calls"]:
                per_step = {k: f"{1000 * v / totals['_step calls']:.2f}" for k, v in totals.items() if "calls" not in k}
                print("ms a step on the engine thread: " + ", ".join(f"{k} {v}" for k, v in per_step.items()))
        model = engine.model
        engine.stop()
        del engine
        if not args.no_http:
            proc, url = start_engine(config)
            try:
                for (_, requests), row in zip(workloads, results, strict=True):
                    for _ in range(2):  # requests arriving over HTTP meet other batch sizes than in-process
                        asyncio.run(over_http(url, requests))
                    before = server_states(url)
                    row.append(row[1] / asyncio.run(over_http(url, requests)))
                    after = server_states(url)
                    steps = sum(after["batch_sizes"].values()) - sum(before["batch_sizes"].values())
                    captures = after["cuda_graph_captures"] - before["cuda_graph_captures"]
                    eager = after["eager_steps"] - before["eager_steps"]
                    eager_s = after["eager_seconds"] - before["eager_seconds"]
                    print(
                        f"{row[0]} over HTTP: {steps} decode steps, of them {eager} eager ({1000 * eager_s:.0f} "
                        f"ms on the engine thread), {captures} CUDA graphs captured in the timed run"
                    )
            finally:
                proc.terminate()
                proc.wait(30)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    params = sum(p.numel() for p in model.parameters()) / 1e6
    what = args.model.name if args.model else "random weights"
    print(f"{what} ({params:.0f} M parameters, vocabulary {model.config.vocab_size}), {device}")
    print("workload | new tokens | in-process tokens/s | ms a step | physical limit tokens/s | share of the limit | "
          "HTTP tokens/s | HTTP / in-process")  # fmt: skip
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for name, tokens, speed, step_ms, limit, share, *http in results:
        via = f"{http[0]:.0f} | {http[0] / speed:.2f}" if http else "- | -"
        print(f"{name} | {tokens} | {speed:.0f} | {step_ms:.2f} | {limit:.0f} | {100 * share:.0f} % | {via}")
    extra = f" --model {args.model}" if args.model else ""
    extra += " --enable-torch-compile" if args.enable_torch_compile else ""
    extra += f" --concurrency {' '.join(map(str, args.concurrency))} --max-new-tokens {args.max_new_tokens}" if (
        args.workload == "concurrency") else ""  # fmt: skip
    print(f"\nReproduce: python bench/engine.py --device {args.device} --workload {args.workload}{extra}"
          + (" --no-http" if args.no_http else ""))  # fmt: skip


if __name__ == "__main__":
    main()
