"""Generation throughput of the reference engine against transformers `generate` on the same batch.

For each concurrency c: c requests of --max-new-tokens tokens each (ignore_eos) are sent at once to a running
`slipstream engine` process; the baseline is one `model.generate` call on the same c prompts (left-padded, greedy,
the same number of new tokens), in this process on the same device.

Run (CPU, a tiny model built on the fly):   .venv/bin/python bench/engine.py
Run (GPU, a ~0.5B Qwen3-shaped random model): python bench/engine.py --device cuda --size 0.5b
Run (GPU, a real model sampled as in RL): python bench/engine.py --device cuda --model runs/real_model/model \
    --temperature 1 --max-new-tokens 48 --concurrency 64
"""

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from services.common.processes import free_port
from services.train.tiny_checkpoint import write_tiny_model

# "0.5b" has Qwen3-0.6B's layers (the vocabulary is the test tokenizer's, so the embeddings are small).
SIZES = {
    "tiny": {"num_layers": 2, "hidden_size": 64},
    "0.5b": {"num_layers": 28, "hidden_size": 1024, "intermediate_size": 3072},
}


def start_engine(model: Path, device: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "services", "engine", "--model-path", str(model), "--port", str(port)]
    cmd += ["--device", device, "--max-running-requests", str(max_batch)]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the engine did not become healthy")


def prompts(count: int) -> list[str]:
    return [f"Question {i}: what is {i} + {2 * i}? Think step by step." for i in range(count)]


async def engine_run(url: str, texts: list[str], new_tokens: int, temperature: float) -> float:
    def body(text: str) -> dict:
        sampling = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
        return {"text": text, "sampling_params": sampling}

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=body(t)) for t in texts))
        elapsed = time.perf_counter() - start
    assert all(len(r.json()["output_ids"]) == new_tokens for r in replies)
    return elapsed


def hf_run(model, tokenizer, texts: list[str], new_tokens: int, device: str, temperature: float) -> float:
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # a chat model may name none
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    start = time.perf_counter()
    with torch.no_grad():
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
        model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling,
                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--model", type=Path, help="an HF checkpoint folder to run instead of a random --size model")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled at this temperature")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or write_tiny_model(Path(tmp) / "model", **SIZES[args.size])
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        proc, url = start_engine(model_path, args.device, max(args.concurrency))
        rows = []
        try:
            asyncio.run(engine_run(url, prompts(2), 4, args.temperature))  # warm-up
            hf_run(model, tokenizer, prompts(2), 4, args.device, args.temperature)
            for c in args.concurrency:
                tokens = c * args.max_new_tokens
                t_engine = asyncio.run(engine_run(url, prompts(c), args.max_new_tokens, args.temperature))
                t_hf = hf_run(model, tokenizer, prompts(c), args.max_new_tokens, args.device, args.temperature)
                rows.append((c, tokens / t_engine, tokens / t_hf))
        finally:
            proc.terminate()
            proc.wait(30)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    what = args.model.name if args.model else f"{args.size} Qwen3-shaped random model"
    decoding = f"sampled at temperature {args.temperature}" if args.temperature else "greedy"
    print(f"{what} ({params:.1f} M parameters), {args.max_new_tokens} new tokens per request, {decoding}; {device}")
    print("concurrency | engine tokens/s | transformers generate tokens/s | engine / generate")
    print("--- | --- | --- | ---")
    for c, engine, hf in rows:
        print(f"{c} | {engine:.0f} | {hf:.0f} | {engine / hf:.2f}")
    concurrency = " ".join(map(str, args.concurrency))
    model = f"--model {args.model}" if args.model else f"--size {args.size}"
    print(f"\nReproduce: python bench/engine.py --device {args.device} {model} --temperature {args.temperature} "
          f"--max-new-tokens {args.max_new_tokens} --concurrency {concurrency}")  # fmt: skip


if __name__ == "__main__":
    main()
