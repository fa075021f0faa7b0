"""The engine thread's own work a step, without a model: what bounds a large batch once the GPU's part overlaps it.

A benchmark-only stub stands in for the model (its forward returns zero logits over a 64-word vocabulary), so what is
timed is the scheduler's Python: the step's bookkeeping, the decode inputs, the sampling calls, reading the tokens
and the stop rules, for `--rows` sequences decoding together through the CUDA-graph path (run eagerly on the CPU).
The sampling's arithmetic on the CPU is included; on a GPU it is queued, not waited for.

Run:  .venv/bin/python bench/engine_thread.py --rows 64 256 512
"""

import argparse
import time
import types

import torch

from services.engine.batch import CacheConfig, Sequence
from services.engine.core import Engine
from services.engine.graphs import DecodeGraphs
from services.engine.sampling import SamplingParams

VOCAB = 64


class StubModel(torch.nn.Module):
    """Benchmark-only: zero logits for the positions asked for."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(max_position_embeddings=8192)
        self.generation_config = None
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, use_cache, logits_to_keep=None):
        count = input_ids.shape[1] if logits_to_keep is None else logits_to_keep.shape[0]
        return types.SimpleNamespace(logits=torch.zeros(1, count, VOCAB))


def seconds_a_step(rows: int, new_tokens: int) -> float:
    tokenizer = types.SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: "")
    device = torch.device("cpu")
    engine = Engine(StubModel(), tokenizer, device, rows, "v1", graphs=DecodeGraphs(device, rows), cache=CacheConfig())
    engine.stop()  # this thread runs its loop's steps itself
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    for i in range(rows):
        seq = Sequence(rid=str(i), prompt_ids=list(range(5 + i % 50, 25 + i % 50)), params=params)
        engine.listeners[id(seq)] = lambda seq, last: None
        engine.waiting.append(seq)
    started = time.perf_counter()
    while engine.waiting or engine.batcher.rows or engine._queued:
        engine._admit()
        queued = engine._step() if engine.batcher.rows else None
        engine._read()
        engine._queued = queued
    return (time.perf_counter() - started) / sum(engine.batch_sizes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="the best of this many runs is shown")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU, {torch.get_num_threads()} thread; the best of {args.repeats} runs of {args.new_tokens} tokens")
    print("rows | ms a step | µs a row a step\n--- | --- | ---")
    for rows in args.rows:
        best = min(seconds_a_step(rows, args.new_tokens) for _ in range(args.repeats))
        print(f"{rows} | {1000 * best:.2f} | {1e6 * best / rows:.2f}")
    print(f"\nReproduce: .venv/bin/python bench/engine_thread.py --rows {' '.join(map(str, args.rows))}")


if __name__ == "__main__":
    main()
