"""`slipstream train` on a model whose weights and AdamW state do not fit one GPU: a Qwen3-8B-shaped bf16 model
(random weights, 8.19 B parameters: 16.4 GB of weights, 33 GB of float32 masters, 66 GB of Adam moments, and the
gradients: over 140 GB) trained with megatron's distributed optimizer over several GPUs, its weights synced to the
engines after every step. Two placements:

- colocated (default): the trainer with tensor parallelism on the engines' GPUs, weights handed over by CUDA IPC;
- `--rollout-gpus N`: N engines on the first N GPUs, the trainer (`--pp` stages or `--tp` ranks) on the next
  `--gpus`, weights broadcast over NCCL, each pipeline stage over its own group (or through the weight receivers,
  `--streamed`). Before the run, a raw NCCL broadcast of the same bytes (each stage's sender to every engine GPU at
  once, a group per stage) gives the figure the sync is measured against.

Prints per step the time split, tokens/s and MFU (the trainer's own metrics), the sync against raw, and the peak
memory of each GPU (nvidia-smi, sampled every 0.5 s).

Run (2 GPUs, colocated):  python bench/large_model.py --shape qwen3-8b
Run (4 GPUs):  python bench/large_model.py --shape qwen3-8b --rollout-gpus 2 --pp 2   (or --tp 2)
Run (CPU, a tiny model, to check the script): .venv/bin/python bench/large_model.py --shape tiny --rollout-gpus 2 --pp 2
"""

import argparse
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.train.demo import write_data
from services.train.tiny_checkpoint import write_tokenizer

SHAPES = {  # Qwen3-8B: 36 layers, untied embeddings; the tiny one, like it, has more embedding rows than tokens
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=1024),
}  # fmt: skip
SETTINGS = [
    "--bf16", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
    "--micro-batch-size", "2", "--rollout-max-response-len", "64", "--rm-type", "random", "--lr", "1e-6",
    "--advantage-estimator", "grpo", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--stall-timeout-s", "600", "--startup-timeout-s", "900",
]  # fmt: skip
TIMEOUT = timedelta(seconds=300)


class PeakMemory(threading.Thread):
    """Each GPU's highest used memory (MiB) while the run lasts."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout  # fmt: skip
            for line in out.splitlines():
                index, used = (int(x) for x in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)


def write_model(path: Path, shape: dict, device: str) -> Path:
    """A Qwen3 checkpoint of `shape` with random bf16 weights (normal, std 0.02; norms 1) and the test tokenizer (its
    few hundred tokens: ids past them decode to nothing, which a random reward ignores). Each tensor is drawn on
    `device` and each layer goes to a file of its own, written by a pool of threads while the next are drawn:
    transformers' save_pretrained wrote the 16 GB from one thread after a float32 init of the whole model."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    write_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = Qwen3Config(**shape, **ids, tie_word_embeddings=False, torch_dtype="bfloat16")
    config.save_pretrained(path)
    GenerationConfig(**ids).save_pretrained(path)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Qwen3ForCausalLM(config).state_dict().items()}
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name in shapes:  # model.layers.N.* together; the embedding alone; the final norm with the output layer
        layer = re.match(r"model\.layers\.\d+", name)
        files.setdefault(layer[0] if layer else "embed" if "embed_tokens" in name else "head", {})[name] = None
    torch.manual_seed(0)
    weight_map = {}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        writes = []
        for index, names in enumerate(files.values()):
            file = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
            tensors = {n: _random(shapes[n], device).cpu() for n in names}
            writes.append(pool.submit(save_file, tensors, path / file, metadata={"format": "pt"}))
            weight_map |= dict.fromkeys(names, file)
        for write in writes:
            write.result()  # a failed write says so
    size = sum(s.numel() * 2 for s in shapes.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return path


def _random(shape, device: str):
    import torch

    if len(shape) == 1:  # the norms
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return torch.randn(shape, dtype=torch.bfloat16, device=device).mul_(0.02)


def stage_specs(model: Path, num_stages: int, dtype) -> list[list[tuple]]:
    """What each pipeline stage's sender sends (HF tensors' dtype and shape): its layers, the embedding on the first,
    the final norm and the output layer on the last (one stage: all of them)."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(model)
    per_stage = config.num_hidden_layers // num_stages
    with torch.device("meta"):
        tensors = Qwen3ForCausalLM(config).state_dict()
    stages = [[] for _ in range(num_stages)]
    for name, tensor in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        stage = int(layer[1]) // per_stage if layer else 0 if "embed_tokens" in name else num_stages - 1
        stages[stage].append((dtype, list(tensor.shape)))
    return stages


def raw_rank(rank: int, stages: list, num_engines: int, gpus: list[int], ports: list[int], reps: int, times) -> None:
    """One process of the raw figure. Ranks below len(stages) send stage `rank`'s tensors from its trainer GPU over
    the stage's group; the others are the engines' GPUs, each a member of every stage's group, receiving them all at
    once as the engines do (a broadcast per tensor). Every rep starts together; a sender's time ends when every engine
    GPU has everything from every stage."""
    import torch
    import torch.distributed as dist

    from services.weightsync.group import apply_nccl_settings, init_custom_process_group

    apply_nccl_settings()  # as every member of a weight group
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", gpus[rank]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", world_size=len(gpus), rank=rank)
    sending = rank < len(stages)
    mine = [rank] if sending else range(len(stages))
    member = 0 if sending else 1 + rank - len(stages)
    groups = {s: init_custom_process_group("nccl" if cuda else "gloo", f"tcp://127.0.0.1:{ports[1 + s]}",
                                           1 + num_engines, member, f"raw_pp{s}", TIMEOUT) for s in mine}  # fmt: skip
    tensors = {s: [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in stages[s]] for s in mine}
    done = torch.ones(1, device=device)
    elapsed = []
    for _ in range(reps + 1):  # the first builds the NCCL communicators
        dist.barrier()
        started = time.perf_counter()
        handles = [dist.broadcast(t, src=0, group=groups[s], async_op=True) for s in mine for t in tensors[s]]
        for handle in handles:
            handle.wait()
        for s in mine:  # tells the sender that all arrived
            dist.all_reduce(done, group=groups[s])
        if cuda:
            torch.cuda.synchronize()
        elapsed.append(time.perf_counter() - started)
    if sending:
        times.put(elapsed[1:])
    for group in groups.values():
        dist.destroy_process_group(group)
    dist.destroy_process_group()


def raw_broadcast(stages: list, num_engines: int, trainer_gpus: int, reps: int) -> list[float]:
    """Each rep's time (the slowest stage's) to broadcast every stage's tensors to every engine GPU at once."""
    import torch.multiprocessing as mp

    from services.common.processes import free_port

    per_stage = trainer_gpus // len(stages)  # a stage's first rank sends: megatron orders ranks TP, DP, then PP
    gpus = [num_engines + s * per_stage for s in range(len(stages))] + list(range(num_engines))
    ports = [free_port() for _ in range(1 + len(stages))]
    context = mp.get_context("spawn")
    times = context.Queue()
    procs = [context.Process(target=raw_rank, args=(rank, stages, num_engines, gpus, ports, reps, times))
             for rank in range(len(gpus))]  # fmt: skip
    for proc in procs:
        proc.start()
    per_sender, deadline = [], time.monotonic() + TIMEOUT.total_seconds()
    while len(per_sender) < len(stages):
        try:
            per_sender.append(times.get(timeout=1))
        except queue.Empty:
            if any(proc.exitcode for proc in procs) or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"the raw broadcast failed (exit codes {[p.exitcode for p in procs]})") from None
    for proc in procs:
        proc.join()
    return [max(rep) for rep in zip(*per_sender, strict=True)]


def train_flags(args, model: Path, folder: Path) -> list[str]:
    train, _ = write_data(folder / "data")
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--output-dir", str(folder), "--run-id",
             "run", "--num-rollout", str(args.steps), "--actor-num-gpus-per-node", str(args.gpus),
             "--use-distributed-optimizer", "--tensor-model-parallel-size", str(args.tp),
             "--pipeline-model-parallel-size", str(args.pp), *SETTINGS]  # fmt: skip
    if not args.rollout_gpus:
        return [*flags, "--rollout-num-gpus", str(args.gpus), "--colocate"]
    streamed = ["--weight-receiver-port-offset", "1"] if args.streamed else []
    return [*flags, "--rollout-num-gpus", str(args.rollout_gpus), *streamed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--gpus", type=int, default=2, help="trainer ranks (colocated: and engines, on those GPUs)")
    parser.add_argument("--rollout-gpus", type=int, default=0,
                        help="engines on GPUs of their own, the first ones (the trainer on the next --gpus); "
                             "0: colocated")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size (needs --rollout-gpus)")
    parser.add_argument("--tp", type=int, default=None, help="--tensor-model-parallel-size; default --gpus / --pp")
    parser.add_argument("--streamed", action="store_true", help="through the weight receivers beside the engines")
    parser.add_argument("--raw-reps", type=int, default=3, help="timed raw broadcasts (after one warm-up)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the random checkpoint: written there if absent, else reused (default: a new one "
                             "beside the run)")  # fmt: skip
    args = parser.parse_args()
    args.tp = args.tp or args.gpus // args.pp
    if args.gpus % (args.tp * args.pp):
        parser.error(f"--gpus {args.gpus} is not a multiple of --tp {args.tp} x --pp {args.pp}")
    if not args.rollout_gpus and (args.pp > 1 or args.streamed):
        parser.error("--pp and --streamed broadcast to engines on GPUs of their own: add --rollout-gpus")
    import torch

    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="large-model-"))
    model = args.model_dir or folder / "model"
    if not (model / "model.safetensors.index.json").exists():
        written = time.monotonic()
        write_model(model, SHAPES[args.shape], "cuda" if cuda else "cpu")
        torch.cuda.empty_cache() if cuda else None
        print(f"checkpoint written in {time.monotonic() - written:.1f} s: {model}", flush=True)
    raw, sizes = [], []
    if args.rollout_gpus:
        stages = stage_specs(model, args.pp, torch.bfloat16 if cuda else torch.float32)
        sizes = [sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in stage) for stage in stages]
        raw = raw_broadcast(stages, args.rollout_gpus, args.gpus, args.raw_reps)
        print(f"raw broadcast of {sum(sizes) / 1e9:.2f} GB: {[round(t, 3) for t in raw]} s", flush=True)
    memory = PeakMemory()
    if shutil.which("nvidia-smi"):
        memory.start()
    started = time.monotonic()
    command = [sys.executable, "-m", "services", "train", *train_flags(args, model, folder)]
    result = subprocess.run(command, capture_output=True, text=True)
    memory.done.set()
    if result.returncode:
        logs = folder / "run" / "logs"
        tails = {p.name: p.read_text()[-2500:] for p in logs.glob("*.log")} if logs.exists() else {}
        raise SystemExit(f"slipstream train failed:\n{result.stderr[-3000:]}\n{json.dumps(tails, indent=1)}")
    steps = [json.loads(line) for line in (folder / "run" / "steps.jsonl").read_text().splitlines()]
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "CPU"
    report(args, steps, raw, sizes, f"{device}; {time.strftime('%Y-%m-%d')}; run {time.monotonic() - started:.0f} s")
    failed = [line for line in (folder / "run" / "logs" / "trainer.log").read_text().splitlines()
              if "weight sync of version" in line]  # fmt: skip
    if failed:
        print("\nsyncs that failed or started over (trainer.log):\n" + "\n".join(failed[:6]))
    if memory.peak:
        print("\npeak memory per GPU: "
              + ", ".join(f"GPU {i}: {mib / 1024:.1f} GiB" for i, mib in sorted(memory.peak.items())))  # fmt: skip


def report(args, steps: list[dict], raw: list[float], sizes: list[int], where: str) -> None:
    layout = f"PP={args.pp}, TP={args.tp}, {args.gpus} trainer ranks, distributed optimizer"
    if args.rollout_gpus:
        path = "streamed through the weight receivers" if args.streamed else "broadcast over the weight groups"
        placement = f"{args.rollout_gpus} engines on GPUs 0-{args.rollout_gpus - 1}, the trainer on the next; {path}"
    else:
        placement = f"{args.gpus} engines colocated with the trainer (CUDA IPC)"
    flags = f" --rollout-gpus {args.rollout_gpus} --pp {args.pp}" if args.rollout_gpus else ""
    flags += " --streamed" if args.streamed else ""
    print(f"\n{args.shape}, {layout}; {placement}; {where}")
    print(f"command: python bench/large_model.py --shape {args.shape} --gpus {args.gpus} --tp {args.tp}{flags} "
          f"--steps {args.steps}\n")  # fmt: skip
    if raw:
        median, size = statistics.median(raw), sum(sizes)
        parts = " + ".join(f"{s / 1e9:.2f}" for s in sizes)
        print(f"raw broadcast (NCCL; gloo on CPU) of the same {size / 1e9:.2f} GB ({parts} GB: a group per sender, "
              f"to every engine GPU at once, a broadcast per tensor): median {median:.3f} s, best {min(raw):.3f} s "
              f"({size / 1e9 / median:.1f} GB/s), {len(raw)} reps\n")  # fmt: skip
    print("| step | step s | train s | sync s | tokens/s | MFU |" + (" raw s | of raw |" if raw else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if raw else ""))
    for step in steps:
        m = step["metrics"]
        against = f" {statistics.median(raw):.3f} | {statistics.median(raw) / m['sync_s']:.0%} |" if raw else ""
        print(f"| {step['step']} | {m['step_s']:.1f} | {m['train_s']:.1f} | {m['sync_s']:.2f} | "
              f"{m.get('tokens_per_s', 0):.0f} | {m.get('mfu', 0):.1%} |{against}")  # fmt: skip
    if raw and len(steps) > 1:
        sync = statistics.median(step["metrics"]["sync_s"] for step in steps[1:])
        print(f"\nsync after the first (which builds the groups): median {sync:.2f} s, "
              f"{statistics.median(raw) / sync:.0%} of raw")  # fmt: skip


if __name__ == "__main__":
    main()
