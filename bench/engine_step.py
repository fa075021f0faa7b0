"""Where a decode step of the reference engine goes: its engine loop in this process (no HTTP), `--concurrency`
sequences of `--max-new-tokens` tokens (ignore_eos) sampled at `--temperature`, timed, then once more under torch's
profiler; prints tokens/s, milliseconds a decode step, device syncs, and the ops that take the most time.
`bench/engine.py` measures the same through the HTTP API beside transformers' `generate`.

Run (GPU, a converted model):  python bench/engine_step.py --device cuda --model runs/real_model/model
Run (CPU, a tiny model):       .venv/bin/python bench/engine_step.py --concurrency 16 --max-new-tokens 16
"""

import argparse
import tempfile
import threading
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from services.engine.batch import Sequence
from services.engine.config import EngineConfig
from services.engine.sampling import SamplingParams
from services.engine.server import load
from services.train.tiny_checkpoint import write_tiny_model

# SmolLM2-135M-Instruct's layers (its config.json), with the test tokenizer's small vocabulary.
SMOLLM2_135M = dict(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


def generate(engine, count: int, new_tokens: int, temperature: float) -> float:
    """Seconds for `count` sequences submitted at once to finish."""
    done, finished = threading.Event(), []
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)

    def listener(seq, last: bool) -> None:
        if last:
            finished.append(seq)
            if len(finished) == count:
                done.set()

    started = time.perf_counter()
    for i in range(count):
        engine.submit(Sequence(rid=str(i), prompt_ids=list(range(10, 40 + i % 7)), params=params), listener)
    done.wait()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", type=Path, help="an HF checkpoint folder (default: a tiny random model)")
    parser.add_argument("--smollm2-shape", action="store_true", help="a random model of SmolLM2-135M's layers")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly (the engine's option)")
    parser.add_argument("--top", type=int, default=15, help="how many ops to list")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shape = SMOLLM2_135M if args.smollm2_shape else {}
        path = args.model or write_tiny_model(Path(tmp) / "model", arch="llama" if shape else "qwen3",
                                              dtype="bfloat16" if shape else "float32", **shape)  # fmt: skip
        config = EngineConfig(model_path=str(path), device=args.device, max_running_requests=args.concurrency)
        engine = load(config.model_copy(update={"disable_cuda_graph": args.disable_cuda_graph}))
        generate(engine, args.concurrency, args.max_new_tokens, args.temperature)  # warm-up: cache, graphs, kernels
        steps_before = sum(engine.batch_sizes.values())
        seconds = generate(engine, args.concurrency, args.max_new_tokens, args.temperature)
        steps = sum(engine.batch_sizes.values()) - steps_before
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        profiled = profile(activities=activities)
        engine.call(profiled.__enter__).result()  # on the engine's thread, where the steps run
        generate(engine, args.concurrency, args.max_new_tokens, args.temperature)
        engine.call(lambda: profiled.__exit__(None, None, None)).result()
        engine.stop()
    events = profiled.key_averages()
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                     "aten::_local_scalar_dense"))  # fmt: skip
    tokens = args.concurrency * args.max_new_tokens
    print(f"{Path(path).name}, {args.concurrency} sequences x {args.max_new_tokens} tokens at temperature "
          f"{args.temperature}, {args.device}: {tokens / seconds:.0f} tokens/s, {steps} decode steps, "
          f"{1000 * seconds / max(steps, 1):.1f} ms a step; under the profiler {syncs} syncs and scalar "
          "reads")  # fmt: skip
    graphs = engine.batcher.graphs
    print("decode: " + (f"CUDA graphs, {graphs.captures} captured" if graphs and not graphs.failed else "eager"))
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.top))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    model = f" --model {args.model}" if args.model else ""
    print(f"Reproduce: python bench/engine_step.py --device {args.device}{model} --concurrency {args.concurrency} "
          f"--max-new-tokens {args.max_new_tokens} --temperature {args.temperature}"
          + (" --disable-cuda-graph" if args.disable_cuda_graph else ""))  # fmt: skip


if __name__ == "__main__":
    main()
