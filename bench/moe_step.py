"""The trainer's RL step on an MoE model with expert parallelism: a Qwen3-30B-A3B-shaped model (its attention, its
128 experts with 8 per token, its vocabulary) with fewer layers, trained by `services.trainer.actor` under torchrun,
each rank holding 1 / EP of every layer's experts (tokens reach them by megatron's all-to-all dispatcher).
`--shape moonlight-16b-a3b`: DeepSeek-V3's architecture at that width (Moonlight-16B-A3B: multi-latent attention, a
dense first layer, then 64 routed experts with 6 per token and 2 shared ones behind a sigmoid router).

Each step trains `--micro-batches` sequences of `--seq-len` tokens per data-parallel rank (here every rank: EP is
carved out of DP) inside megatron's DDP, as the trainer runs it; bf16 with float32 AdamW masters (sharded over the
data-parallel ranks with `--use-distributed-optimizer`). Tokens/s counts all tokens of the step over all GPUs; MFU
uses the active parameters (attention, router, 8 experts' MLPs, embeddings) in the PaLM count 6·N + 12·L·H·Q·S.

The experts are the trainer's (`--experts grouped`: two grouped GEMMs a layer, services/trainer/grouped_experts.py);
`--experts sequential` runs megatron's SequentialMLP instead (one GEMM per expert and projection), for comparison.

Run (GPUs):  python bench/moe_step.py --ep 2 --layers 3 [--experts sequential] [--shape moonlight-16b-a3b]
Run (CPU, a tiny model, to check the script): .venv/bin/python bench/moe_step.py --ep 2 --tiny --seq-len 64
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936, norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960)  # fmt: skip
MOONLIGHT_16B_A3B = dict(hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_attention_heads=16,
                         num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                         first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                         norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, rope_theta=50000.0,
                         max_position_embeddings=8192)  # fmt: skip
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=512,
            norm_topk_prob=True)  # fmt: skip
TINY_MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                vocab_size=512, max_position_embeddings=1024)  # fmt: skip
SHAPES = {  # name: (the HF architecture, its shape, a tiny one of the same architecture)
    "qwen3-30b-a3b": ("Qwen3Moe", QWEN3_30B_A3B, TINY),
    "moonlight-16b-a3b": ("DeepseekV3", MOONLIGHT_16B_A3B, TINY_MLA),
}
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4}


def hf_model(architecture: str, shape: dict):
    """transformers' model of `architecture` (Qwen3Moe, DeepseekV3) with `shape`, on the current default device."""
    import transformers

    config = getattr(transformers, f"{architecture}Config")(**shape, tie_word_embeddings=False, torch_dtype="bfloat16")
    return getattr(transformers, f"{architecture}ForCausalLM")(config)


def write_model(path: Path, architecture: str, shape: dict) -> None:
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = hf_model(architecture, shape).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None  # the GPU's memory is the trainer's


def worker(path: Path, args) -> dict:
    """One torchrun rank: times the steps, returns its figures."""
    from megatron.core import parallel_state

    from services.trainer import data_parallel
    from services.trainer.actor import Actor, Groups
    from services.trainer.config import TrainerConfig
    from services.trainer.data import RolloutBatch
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    if args.experts == "sequential":  # benchmark-only: SequentialMLP's own forward, for the comparison
        from services.trainer.grouped_experts import GroupedExperts

        GroupedExperts.grouped = lambda self, hidden: False
    init_parallel(1, 1, ep_size=args.ep)
    cuda = torch.cuda.is_available()
    model, gpt = load_gpt_model(path, dtype=torch.bfloat16 if cuda else torch.float32)
    n, dp = args.micro_batches, parallel_state.get_data_parallel_world_size()
    config = TrainerConfig(rollout_batch_size=1, n_samples_per_prompt=n * dp, global_batch_size=n * dp,
                           micro_batch_size=1, lr=1e-6, clip_grad=1.0, expert_model_parallel_size=args.ep,
                           adam_beta2=0.999, bf16=cuda, use_distributed_optimizer=args.use_distributed_optimizer,
                           compile_model=args.compile, use_dynamic_batch_size=args.max_tokens_per_gpu is not None,
                           max_tokens_per_gpu=args.max_tokens_per_gpu)  # fmt: skip
    ddp, optimizer, scheduler = data_parallel.build(model, config, config.optimizer)
    groups = Groups(dp=parallel_state.get_data_parallel_group(), vocab_size=gpt.shape.vocab_size,
                    expert_model_parallel=parallel_state.get_expert_tensor_model_pipeline_parallel_group())  # fmt: skip
    actor = Actor(config, model, optimizer, scheduler, groups, ddp=ddp)
    gen = torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, gpt.shape.vocab_size, (n, args.seq_len), generator=gen)
    response = args.seq_len - args.prompt_len
    old, adv = -torch.rand(n, response, generator=gen) * 3, torch.randn(n, response, generator=gen)
    rollout = RolloutBatch(
        tokens=list(tokens.numpy()), prompt_lengths=[args.prompt_len] * n,
        loss_masks=[torch.ones(response).numpy()] * n, rollout_logprobs=list(old.numpy()), rewards_B=torch.zeros(n),
        group_size=n, sample_ids=[str(i) for i in range(n)],
    )  # fmt: skip
    tensors = {"old": old, "ref": None, "adv": adv, "mask": torch.ones(n, response), "rollout": old}
    model.train()
    for _ in range(args.warmup):
        actor._step(rollout, list(range(n)), tensors)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []  # each step's seconds, to show the spread beside the mean
    for _ in range(args.steps):
        started = time.perf_counter()
        metrics = actor._step(rollout, list(range(n)), tensors)
        torch.cuda.synchronize() if cuda else None
        steps.append(time.perf_counter() - started)
    seconds = sum(steps) / len(steps)
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    if args.profile:  # every rank steps (the step's collectives need them all); rank 0 reports
        profile(lambda: actor._step(rollout, list(range(n)), tensors), args.profile, cuda, args.trace,
                report=int(os.environ.get("RANK", 0)) == 0)  # fmt: skip
    return {"step_s": seconds, "steps_s": steps, "memory_gib": memory,
            "load_balancing_loss": metrics.get("load_balancing_loss")}  # fmt: skip


def profile(step, top: int, cuda: bool, trace: str | None, report: bool) -> None:
    """One more step under the torch profiler: its `top` operators by their own device time (CPU time on a CPU), and
    its timeline in `trace` (Chrome's trace format) where given."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profiler(activities=activities) as prof:
        step()
        torch.cuda.synchronize() if cuda else None
    if not report:
        return
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)
    if trace:
        prof.export_chrome_trace(trace)


def params(architecture: str, shape: dict) -> tuple[float, float]:
    """The model's parameters, all and active (a token's: the routed experts it does not reach left out), counted on
    transformers' model of the architecture, built without memory."""
    with torch.device("meta"):
        model = hf_model(architecture, shape)
    total = sum(p.numel() for p in model.parameters())
    routed = shape.get("num_experts") or shape["n_routed_experts"]
    moe_layers = shape["num_hidden_layers"] - shape.get("first_k_dense_replace", 0)
    idle = (
        moe_layers * (routed - shape["num_experts_per_tok"]) * 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
    )
    return total, total - idle


def attention_dims(shape: dict) -> tuple[int, int]:
    """A head's query-key and value widths (multi-latent attention's differ)."""
    if "kv_lora_rank" in shape:
        return shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"], shape["v_head_dim"]
    return shape["head_dim"], shape["head_dim"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size = GPUs (torchrun processes)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the shape's architecture, for a CPU")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard AdamW's state over the data-parallel ranks (megatron's DistributedOptimizer)",
    )
    parser.add_argument("--compile", action="store_true", help="the trainer's --compile-model (torch.compile'd layers)")
    parser.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        help="the trainer's dynamic micro-batches (--use-dynamic-batch-size) of up to this many tokens",
    )
    parser.add_argument("--experts", choices=("grouped", "sequential"), default="grouped",
                        help="the trainer's grouped experts, or megatron's SequentialMLP to compare")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more step and print its N most costly operators")  # fmt: skip
    parser.add_argument("--trace", help="with --profile: write the profiled step's timeline here (Chrome's format)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prompt_len = min(args.prompt_len, args.seq_len // 2)
    architecture, full, tiny = SHAPES[args.shape]
    shape = {**(tiny if args.tiny else full), "num_hidden_layers": args.layers}
    if args.worker:  # a torchrun rank: the model folder and where to write the figures
        path, out = args.worker.split(",")
        figures = worker(Path(path), args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(out).write_text(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp) / "model", architecture, shape)
        out = Path(tmp) / "figures.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ep), __file__,
                   *sys.argv[1:], "--worker", f"{Path(tmp) / 'model'},{out}"]  # fmt: skip
        path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": path})
        figures = json.loads(out.read_text())
    report(figures, args, architecture, shape)


def report(figures: dict, args, architecture: str, shape: dict) -> None:
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "CPU"
    peak = next((p for key, p in PEAK_TFLOPS.items() if key in name), None)
    tokens = args.ep * args.micro_batches * args.seq_len
    rate = tokens / figures["step_s"]
    (qk, v), layers = attention_dims(shape), shape["num_hidden_layers"]
    total, active = params(architecture, shape)
    flops = 6 * active + 6 * layers * shape["num_attention_heads"] * (qk + v) * args.seq_len
    mfu = f"{rate / args.ep * flops / (peak * 1e12):.1%}" if peak else "n/a"
    loss = figures["load_balancing_loss"]  # none where the router balances by its score correction (DeepSeek-V3)
    balance = "n/a" if loss is None else f"{loss:.4f}"
    print(f"\n{args.shape}-shaped{' (tiny)' * args.tiny}, {layers} layers ({total / 1e9:.2f} B params over {args.ep} "
          f"rank(s), {active / 1e9:.2f} B active), EP={args.ep}, {args.micro_batches} x "
          f"{args.seq_len} tokens per rank per step, bf16 + fp32 AdamW, {args.experts} experts"
          f"{', compiled layers' * args.compile}"
          f"{f', micro-batches of up to {args.max_tokens_per_gpu} tokens' if args.max_tokens_per_gpu else ''}"
          f"{' (distributed optimizer)' if args.use_distributed_optimizer else ''}; {args.ep} x {name}")  # fmt: skip
    print("EP | step s | tokens/s | tokens/s per GPU | MFU | peak memory per GPU | load-balancing loss")
    print("--- | --- | --- | --- | --- | --- | ---")
    print(f"{args.ep} | {figures['step_s']:.3f} | {rate:,.0f} | {rate / args.ep:,.0f} | {mfu} | "
          f"{figures['memory_gib']:.1f} GiB | {balance}")  # fmt: skip
    print(f"\nEach step, s: {' '.join(f'{s:.3f}' for s in figures['steps_s'])}")
    print(
        f"\nReproduce: python bench/moe_step.py --ep {args.ep} --layers {layers} --seq-len {args.seq_len} "
        f"--micro-batches {args.micro_batches} --experts {args.experts} --shape {args.shape}{' --tiny' * args.tiny}"
        f"{' --use-distributed-optimizer' * args.use_distributed_optimizer}{' --compile' * args.compile}"
        f"{f' --max-tokens-per-gpu {args.max_tokens_per_gpu}' if args.max_tokens_per_gpu else ''}"
    )


if __name__ == "__main__":
    main()
