"""The RL training step — log-probs of the sampled tokens, policy loss, backward, optimizer step — of the trainer
(Megatron-core GPTModel, SDPA attention, chunked log-probs, `services.trainer.actor`) against HF transformers (sdpa)
doing the same step on the same random model, batch and device, in the same run.

Each step trains `--micro-batches` sequences of `--seq-len` tokens (the first `--prompt-len` are the prompt, the
rest the response that is trained on); both sides compute the same PPO-clip loss (`services.trainer.losses`) and
use AdamW on bf16 parameters. Tokens/s counts all tokens of the step; MFU uses the PaLM count, 6·N + 12·L·H·Q·S
FLOPs per token, against the GPU's dense bf16 peak. `--use-distributed-optimizer` adds the actor inside megatron's
DDP with torch's AdamW (the trainer's default) and with megatron's DistributedOptimizer (on one GPU: its cost, with
none of its memory saving, which grows with the data-parallel size).

Run (GPU):  python bench/trainer_step.py --shape qwen3-1.7b --use-distributed-optimizer
            python bench/trainer_step.py --shape qwen3-0.6b --seq-len 16384 --micro-batches 1 --log-probs-from-hidden
Run (CPU, a tiny model, to check the script): .venv/bin/python bench/trainer_step.py --shape tiny --seq-len 64
"""

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Qwen3-1.7B's layers with an untied output layer (2.03 B parameters); 0.6B and 4B tie it
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512),
}  # fmt: skip
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4}


def write_model(path: Path, shape: dict, device: str, tie: bool = False) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, tie_word_embeddings=tie, rope_theta=1e6, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def batch(args, vocab: int, device: str):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.micro_batches, args.seq_len), generator=gen)
    response = args.seq_len - args.prompt_len
    old = -torch.rand(args.micro_batches, response, generator=gen) * 3  # an old policy's log-probs
    adv = torch.randn(args.micro_batches, response, generator=gen)
    return tokens.to(device), old.to(device), adv.to(device)


def loss_of(logprobs, old, adv):
    from services.trainer.losses import policy_loss

    mask = torch.ones_like(logprobs)
    return policy_loss(logprobs, mask, old_logprobs_BT=old, advantages_BT=adv)[0]


def time_steps(step, args, label: str = "") -> float:
    for _ in range(args.warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\n== {label}: top kernels of one step ==")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return (time.perf_counter() - started) / args.steps


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def run_hf(path: Path, args, device: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tokens, old, adv = batch(args, model.config.vocab_size, device)
    p = args.prompt_len

    def step():
        for i in range(args.micro_batches):
            ids = tokens[i : i + 1]
            logits = model(input_ids=ids).logits[:, p - 1 : -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1)
            loss_of(logprobs, old[i : i + 1], adv[i : i + 1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, args, "HF")


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def run_megatron(path: Path, args, device: str, compile_layers: bool = False, max_tokens: int | None = None,
                 data_parallel: str = "", lora_rank: int = 0, from_hidden: bool = False,
                 recompute_activations: bool = False) -> float:  # fmt: skip
    """The actor's step; `data_parallel` "ddp": inside megatron's DDP with torch's AdamW, "sharded": with megatron's
    DistributedOptimizer; "": neither (the actor alone, as on one GPU before megatron's DDP). `lora_rank`: LoRA
    adapters of that rank on every linear layer, the base frozen. `from_hidden`: log-probs streamed over the
    vocabulary from the last hidden states (--log-probs-from-hidden), not from full logits. `recompute_activations`:
    each layer's activations recomputed in the backward pass (--recompute-activations)."""
    from services.trainer import data_parallel as dp
    from services.trainer.actor import Actor, Groups
    from services.trainer.config import TrainerConfig
    from services.trainer.data import RolloutBatch
    from services.trainer.models import load_gpt_model
    from services.trainer.optimizer import build_optimizer, build_scheduler
    from services.trainer.parallel import init_parallel

    init_parallel(1, 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model, gpt = load_gpt_model(path, dtype=dtype, **(recompute if recompute_activations else {}))
    if lora_rank:
        from services.trainer import lora

        lora.apply(model, lora.LoraSettings(lora_rank, 2.0 * lora_rank, 0.0, ("all-linear",)), gpt.shape)
    n = args.micro_batches
    config = TrainerConfig(rollout_batch_size=1, n_samples_per_prompt=n, global_batch_size=n, micro_batch_size=1,
                           lr=1e-6, clip_grad=0.0, eps_clip=0.2, use_dynamic_batch_size=max_tokens is not None,
                           max_tokens_per_gpu=max_tokens, compile_model=compile_layers, bf16=dtype == torch.bfloat16,
                           adam_beta2=0.999, use_distributed_optimizer=data_parallel == "sharded",
                           log_probs_from_hidden=from_hidden,
                           recompute_activations=recompute_activations)  # fmt: skip
    groups = Groups(vocab_size=gpt.shape.vocab_size)
    if data_parallel:
        ddp, optimizer, scheduler = dp.build(model, config, config.optimizer)
        actor = Actor(config, model, optimizer, scheduler, groups, ddp=ddp)
    else:
        optimizer = build_optimizer(model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        scheduler = build_scheduler(optimizer, 0, None, "constant", 1e-6, 0.0)
        actor = Actor(config, model, optimizer, scheduler, groups)
    tokens, old, adv = batch(args, gpt.shape.vocab_size, "cpu")
    response = args.seq_len - args.prompt_len
    rollout = RolloutBatch(
        tokens=list(tokens.numpy()), prompt_lengths=[args.prompt_len] * n,
        loss_masks=[torch.ones(response).numpy()] * n, rollout_logprobs=list(old.numpy()),
        rewards_B=torch.zeros(n), group_size=n, sample_ids=[str(i) for i in range(n)],
    )  # fmt: skip
    tensors = {"old": old, "ref": None, "adv": adv, "mask": torch.ones(n, response), "rollout": old}
    model.train()
    label = f"trainer{' compiled' if compile_layers else ''}{f' {max_tokens} tokens' if max_tokens else ''}"
    return time_steps(lambda: actor._step(rollout, list(range(n)), tensors), args, f"{label} {data_parallel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-1.7b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time the trainer with torch.compile'd layers")
    parser.add_argument("--max-tokens-per-gpu", type=int, help="also time the trainer with dynamic micro-batches")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="also time the trainer in megatron's DDP, with torch's AdamW and with megatron's "
                             "DistributedOptimizer")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print each path's top GPU kernels")
    parser.add_argument("--lora-rank", type=int, default=0, help="also time the trainer with LoRA of this rank")
    parser.add_argument("--recompute-activations", action="store_true",
                        help="also time the trainer recomputing its layers' activations in the backward pass (with "
                             "--log-probs-from-hidden: both)")  # fmt: skip
    parser.add_argument(
        "--log-probs-from-hidden",
        action="store_true",
        help="also time the trainer with log-probs streamed from the hidden states (no full logits)",
    )
    args = parser.parse_args()
    args.prompt_len = min(args.prompt_len, args.seq_len // 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), shape, device, tie=args.shape != "qwen3-1.7b")
        results = [("HF transformers (sdpa)", run_hf(Path(tmp), args, device), peak_gib())]
        free_memory()
        results.append(("slipstream trainer (Megatron-core + SDPA)", run_megatron(Path(tmp), args, device), peak_gib()))
        free_memory()
        if args.log_probs_from_hidden:
            label = "slipstream trainer, --log-probs-from-hidden"
            results.append((label, run_megatron(Path(tmp), args, device, from_hidden=True), peak_gib()))
            free_memory()
        if args.recompute_activations:
            hidden = args.log_probs_from_hidden
            label = f"slipstream trainer,{' --log-probs-from-hidden' if hidden else ''} --recompute-activations"
            seconds = run_megatron(Path(tmp), args, device, from_hidden=hidden, recompute_activations=True)
            results.append((label, seconds, peak_gib()))
            free_memory()
        if args.lora_rank:
            label = f"slipstream trainer, LoRA rank {args.lora_rank} on all linear layers"
            results.append((label, run_megatron(Path(tmp), args, device, lora_rank=args.lora_rank), peak_gib()))
            free_memory()
        if args.use_distributed_optimizer:
            for label, kind in (
                ("slipstream trainer, megatron DDP + AdamW", "ddp"),
                ("slipstream trainer, megatron DDP + --use-distributed-optimizer", "sharded"),
            ):
                results.append((label, run_megatron(Path(tmp), args, device, data_parallel=kind), peak_gib()))
                free_memory()
        if args.max_tokens_per_gpu:
            label = f"slipstream trainer, --max-tokens-per-gpu {args.max_tokens_per_gpu}"
            seconds = run_megatron(Path(tmp), args, device, max_tokens=args.max_tokens_per_gpu)
            results.append((label, seconds, peak_gib()))
            free_memory()
        if args.compile:
            label = "slipstream trainer, --compile-model" + (
                f", --max-tokens-per-gpu {args.max_tokens_per_gpu}" if args.max_tokens_per_gpu else ""
            )
            results.append((label, run_megatron(Path(tmp), args, device, True, args.max_tokens_per_gpu), peak_gib()))
    report(results, args, shape, device)


def report(results, args, shape: dict, device: str) -> None:
    h, layers, v, q = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"], shape["head_dim"]
    heads, kv, ffn = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    params = 2 * v * h + layers * (h * q * (2 * heads + 2 * kv) + 3 * h * ffn)
    flops_per_token = 6 * params + 12 * layers * heads * q * args.seq_len
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    peak = next((p for key, p in PEAK_TFLOPS.items() if key in name), None)
    tokens = args.micro_batches * args.seq_len
    print(f"\n{args.shape} ({params / 1e9:.2f} B params), {args.micro_batches} x {args.seq_len} tokens per step, "
          f"bf16, AdamW; {name}")  # fmt: skip
    print("path | step s | tokens/s | vs HF | MFU | peak memory")
    print("--- | --- | --- | --- | --- | ---")
    base = tokens / results[0][1]
    for label, seconds, memory in results:
        rate = tokens / seconds
        mfu = f"{rate * flops_per_token / (peak * 1e12):.1%}" if peak else "n/a"
        memory = f"{memory:.1f} GiB" if memory == memory else "n/a"  # nan on the CPU
        print(f"{label} | {seconds:.3f} | {rate:,.0f} | {rate / base:.2f}x | {mfu} | {memory}")
    print(f"\nReproduce: python bench/trainer_step.py --shape {args.shape} --seq-len {args.seq_len} "
          f"--micro-batches {args.micro_batches}{' --compile' if args.compile else ''}"
          f"{' --use-distributed-optimizer' if args.use_distributed_optimizer else ''}"
          f"{f' --max-tokens-per-gpu {args.max_tokens_per_gpu}' if args.max_tokens_per_gpu else ''}"
          f"{f' --lora-rank {args.lora_rank}' if args.lora_rank else ''}"
          f"{' --log-probs-from-hidden' if args.log_probs_from_hidden else ''}"
          f"{' --recompute-activations' if args.recompute_activations else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
