"""Weight sync end to end against a raw NCCL broadcast of the same bytes, in the same run.

The trainer side is this process: a Megatron-core GPTModel (random Qwen3-4B-shaped bf16 weights) on GPU 0, sending
through `services.trainer.weight_sync.WeightSender` — Megatron → HF names, buckets, PrepareWeightSync /
SyncWeightBuckets / CommitWeightSync on a real gateway, NCCL broadcast to a `slipstream engine` on GPU 1, which loads
every bucket, takes the new weight version and generates again; the gateway also tells a real buffer the version.
A sync is timed from the trainer's call to CommitWeightSync's answer (the engine then serves the new version).
The raw figure broadcasts the same tensors (the same names, dtypes and shapes, one broadcast each, received as the
engine receives them) between this process and a bare receiver process on GPU 1.

Run (2 GPUs):  python bench/weight_sync.py --shape qwen3-4b
Run (CPU, tiny, to check the script): .venv/bin/python bench/weight_sync.py --shape tiny --syncs 2
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import moe_step
from trainer_step import write_model

from services.common.processes import free_port, free_port_pair

SHAPES = {  # Qwen3-4B: 36 layers, tied embeddings, 4.02 B parameters (8.05 GB in bf16, 398 tensors)
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512),
    # MoE (Qwen3-MoE files, one tensor per expert): Qwen3-30B-A3B with 3 of its 48 layers, as bench/moe_step.py
    "qwen3-30b-a3b-3l": dict(moe_step.QWEN3_30B_A3B, num_hidden_layers=3),
    "tiny-moe": dict(moe_step.TINY, num_hidden_layers=2),
}  # fmt: skip


TIMEOUT = timedelta(seconds=120)


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "services", *args], stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} did not come up:\n{log.read_text()[-3000:]}")


def start_system(model: Path, folder: Path, cuda: bool, gpu: str, streamed: bool, lora_rank: int = 0,
                 mps: dict | None = None) -> tuple[str, str, list]:  # fmt: skip
    """A buffer (embedded Redis), one engine (GPU 1 on CUDA), with `streamed` the weight receiver beside it (its port
    + 1), and the gateway; returns (engine URL, gateway address, processes). With `lora_rank` the engine serves
    adapters and the gateway takes LoRA syncs through folder/adapters. `mps`: the MPS daemon's environment, for the
    engine and its receiver."""
    from services.common.clients import wait_until_serving

    engine_port, buffer_port, gateway_port = free_port_pair(), free_port(), free_port()
    env = {"CUDA_VISIBLE_DEVICES": gpu, **(mps or {})} if cuda else None
    device = ["--device", "cuda", "--dtype", "bfloat16"] if cuda else []
    lora, lora_gateway = [], []
    if lora_rank:
        from services.rollout.adapters import server_options

        adapters = str(folder / "adapters")
        lora = [*server_options(SimpleNamespace(lora_rank=lora_rank, target_modules=["all-linear"])),
                "--weight-disk-dir", adapters]  # fmt: skip
        lora_gateway = ["--lora-rank", str(lora_rank), "--update-weight-disk-dir", adapters]
    engine = start(["engine", "--model-path", str(model), "--port", str(engine_port), *device, *lora],
                   folder / "engine.log", env)  # fmt: skip
    buffer = start(["buffer", "--port", str(buffer_port), "--metrics-port", "null", "--output-dir", str(folder)],
                   folder / "buffer.log")  # fmt: skip
    url = f"http://127.0.0.1:{engine_port}"
    procs = [engine, buffer]
    wait_http(url, engine, folder / "engine.log")
    receivers = []
    if streamed:
        receiver = start(["receiver", "--engine-url", url, "--port", str(engine_port + 1), "--timeout-s", "300",
                          "--device", "cuda" if cuda else "cpu"], folder / "receiver.log", env)  # fmt: skip
        procs.append(receiver)
        wait_http(f"http://127.0.0.1:{engine_port + 1}", receiver, folder / "receiver.log")
        receivers = ["--weight-receiver-port-offset", "1"]
    gateway = start(["rollout", "--port", str(gateway_port), "--metrics-port", "null", "--engine-urls", url,
                     "--buffer-addr", f"127.0.0.1:{buffer_port}", "--reward-addr", f"127.0.0.1:{free_port()}",
                     *receivers, *lora_gateway], folder / "gateway.log")  # fmt: skip
    for port in (buffer_port, gateway_port):
        wait_until_serving(f"127.0.0.1:{port}", timeout_s=120)
    return url, f"127.0.0.1:{gateway_port}", [*procs, gateway]


def start_mps(folder: Path) -> dict:
    """An MPS control daemon (every GPU) with its pipes in `folder`; returns the environment that puts a process under
    it. The trainer and the raw receiver stay outside: only the engine's GPU is shared by two processes."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "mps"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "mps-log")}
    for path in env.values():
        Path(path).mkdir()
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, check=True, timeout=30)
    return env


def stop_mps(env: dict) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **env}, timeout=60)


def receive_raw(port: int, specs: list, reps: int) -> None:
    """The raw receiver (GPU 1): every tensor by its own broadcast, as the engine receives, `reps` times."""
    from services.weightsync.group import apply_nccl_settings, init_custom_process_group

    apply_nccl_settings()  # as every member of a weight group
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 1) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = init_custom_process_group("nccl" if cuda else "gloo", f"tcp://127.0.0.1:{port}", 2, 1, "raw", TIMEOUT)
    for _ in range(reps):
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
        handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()
        torch.distributed.all_reduce(torch.ones(1, device=device), group=group)  # tells the sender all arrived
        del tensors
    torch.distributed.destroy_process_group(group)


def raw_broadcast(tensors: list[torch.Tensor], reps: int) -> list[float]:
    from services.weightsync.group import init_custom_process_group

    port = free_port()
    specs = [(t.dtype, list(t.shape)) for t in tensors]
    receiver = mp.get_context("spawn").Process(target=receive_raw, args=(port, specs, reps + 1), daemon=True)
    receiver.start()
    cuda = torch.cuda.is_available()
    group = init_custom_process_group("nccl" if cuda else "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "raw", TIMEOUT)
    done = torch.zeros(1, device=tensors[0].device)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync()
        started = time.perf_counter()
        for tensor in tensors:
            torch.distributed.broadcast(tensor, src=0, group=group)
        torch.distributed.all_reduce(done, group=group)
        sync()
        times.append(time.perf_counter() - started)
    receiver.join()
    torch.distributed.destroy_process_group(group)
    return times[1:]


def engine_memory(pid: int, action) -> tuple:
    """The engine's GPU memory (MiB, from nvidia-smi) before and after `action()`; empty without nvidia-smi."""

    def used() -> int | None:
        try:
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        rows = dict(line.split(", ") for line in out.strip().splitlines() if ", " in line)
        return int(rows[str(pid)]) if str(pid) in rows else None

    before = used()
    action()
    return before, used()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-4b")
    parser.add_argument("--bucket-mib", type=float, nargs="+", default=[512, 2048, 16384])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per bucket size (after one warm-up)")
    parser.add_argument("--colocate", action="store_true", help="the engine on GPU 0 with the trainer: CUDA IPC")
    parser.add_argument("--load-formats", nargs="+", choices=["per-tensor", "flattened"], default=["per-tensor"],
                        help="each bucket size with each: a broadcast per tensor, or one flattened_bucket")  # fmt: skip
    parser.add_argument("--buckets-in-flight", type=int, default=2, help="--update-weight-buckets-in-flight")
    parser.add_argument("--streamed", action="store_true",
                        help="through a weight receiver beside the engine: the plan in one call, the buckets streamed "
                             "into SGLang's /update_weights_from_ipc route (the reference engine's)")  # fmt: skip
    parser.add_argument(
        "--update-weight-mode",
        choices=["full", "delta"],
        default="full",
        help="delta: only the words that changed since the engine's version (needs --streamed)",
    )
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="then LoRA syncs: adapters of this rank on every linear layer, as a folder the engine "
                             "loads (services/*/transports/lora.py), timed against the full syncs")  # fmt: skip
    parser.add_argument("--mps", action="store_true",
                        help="the engine and its receiver under an MPS daemon started for the run, so that the "
                             "engine's copies run beside the receiver's transfer (docs/DEPLOY.md)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=None,
                        help="before each sync, one training step at this lr (AdamW on float32 masters, as the "
                             "trainer's --bf16) on random tokens; unset: one weight changes by 1")  # fmt: skip
    args = parser.parse_args()
    if args.update_weight_mode == "delta" and not args.streamed:
        parser.error("--update-weight-mode delta goes through the weight receivers: add --streamed")
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < 2 and not args.colocate:
        sys.exit("needs 2 GPUs: the trainer on GPU 0, the engine on GPU 1")
    from services.common.launch import gpu_ids

    folder = args.folder = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    model_dir = folder / "model"
    shape = SHAPES[args.shape]
    if "num_experts" in shape:
        moe_step.write_model(model_dir, "Qwen3Moe", shape)
    else:
        write_model(model_dir, shape, "cuda" if cuda else "cpu", tie=True)
    engine_gpu = gpu_ids()[0 if args.colocate else 1] if cuda else ""  # this process's GPU 0 or 1, as CUDA names it
    if args.mps and not cuda:
        sys.exit("--mps needs GPUs")
    mps = start_mps(folder) if args.mps else None
    try:
        run(args, folder, model_dir, shape, cuda, engine_gpu, mps)
    finally:
        if mps:
            stop_mps(mps)


def run(args, folder: Path, model_dir: Path, shape: dict, cuda: bool, engine_gpu: str, mps: dict | None) -> None:
    from services.common.config import AuthConfig, TlsConfig
    from services.trainer.models import WeightViews, hf_weights_of, load_gpt_model
    from services.trainer.parallel import init_parallel
    from services.trainer.weight_sync import WeightSender

    url, gateway, procs = start_system(model_dir, folder, cuda, engine_gpu, args.streamed, args.lora_rank, mps)
    try:
        init_parallel(1, 1)
        model, gpt = load_gpt_model(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
        optimizer = None
        if args.lr is not None:
            from services.trainer.optimizer import build_optimizer

            optimizer = build_optimizer(model, args.lr, 0.0, (0.9, 0.98), 1e-8)
        tensors = [t.contiguous() for _, t in hf_weights_of(model, gpt)]
        size = sum(t.numel() * t.element_size() for t in tensors)
        print(f"raw broadcast of {len(tensors)} tensors", flush=True)
        raw = raw_broadcast(tensors, args.syncs) if not args.colocate else [float("nan")]
        print(f"raw: {[round(t * 1e3, 1) for t in raw]} ms", flush=True)
        del tensors
        rows, version = [], 0
        for mib, load_format in [(mib, form) for mib in args.bucket_mib for form in args.load_formats]:
            config = SimpleNamespace(rollout_addr=gateway, update_weight_buffer_size=int(mib * 2**20),
                                     update_weight_mode=args.update_weight_mode, update_weight_transport="nccl",
                                     colocate=args.colocate, update_weight_flattened_bucket=load_format == "flattened",
                                     update_weight_buckets_in_flight=args.buckets_in_flight,
                                     weight_sync_address="127.0.0.1", weight_sync_timeout_s=300, tls=TlsConfig(),
                                     auth=AuthConfig(), lora_rank=0)  # fmt: skip
            views = WeightViews(model, gpt)
            sender = WeightSender(config, lambda: hf_weights_of(model, gpt), sender=True, views=views)
            times, phases = [], []
            for rep in range(args.syncs + 1):  # the first builds the group
                version += 1
                if args.lr is None:
                    with torch.no_grad():
                        next(model.parameters()).add_(1.0)  # new weights each time
                else:
                    train_step(model, optimizer, shape["vocab_size"])
                if args.colocate:  # the trainer's step starts by taking the engine's memory
                    released = engine_memory(procs[0].pid, sender.release)
                seconds = timed_sync(sender, version, folder)
                if rep:
                    times.append(seconds)
                    phases.append(sender.timings)
            sender.close()
            print(f"{mib:g} MiB buckets, {load_format}: {[round(t * 1e3, 1) for t in times]} ms", flush=True)
            if args.colocate:
                print(f"engine GPU memory before and after ReleaseEngineMemory: {released} MiB", flush=True)
            check(url, model, gpt, version)
            rows.append((mib, load_format, sender.layout, times, phases))
        adapters = lora_syncs(args, model, gpt, gateway, folder, model_dir, version) if args.lora_rank else None
        report(args, size, len(list(hf_weights_of(model, gpt))), raw, rows, adapters)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def timed_sync(sender, version: int, folder: Path) -> float:
    """Seconds of one sync of `version`, from the trainer's call to the commit's answer."""
    sync()
    started = time.perf_counter()
    assert sender.sync(version), f"sync of version {version} failed: see {folder}/gateway.log"
    return time.perf_counter() - started


def lora_syncs(args, model, gpt, gateway: str, folder: Path, model_dir: Path, version: int) -> tuple:
    """Adapters of --lora-rank on every linear layer (B random: a trained adapter's size), synced --syncs times after
    a warm-up; returns (bytes, times, phases)."""
    from services.common.config import AuthConfig, TlsConfig
    from services.trainer import lora
    from services.trainer.weight_sync import WeightSender

    settings = lora.LoraSettings(args.lora_rank, 2.0 * args.lora_rank, 0.0, ("all-linear",))
    lora.apply(model, settings, gpt.shape)
    config = SimpleNamespace(rollout_addr=gateway, update_weight_buffer_size=512 * 2**20, update_weight_mode="full",
                             update_weight_transport="nccl", colocate=False, update_weight_flattened_bucket=False,
                             update_weight_buckets_in_flight=2, weight_sync_address="127.0.0.1",
                             weight_sync_timeout_s=300, tls=TlsConfig(), auth=AuthConfig(), lora_rank=args.lora_rank,
                             lora_alpha=settings.alpha, lora_dropout=0.0, target_modules=["all-linear"],
                             update_weight_disk_dir=str(folder / "adapters"), update_weight_disk_keep_files=False,
                             hf_checkpoint=str(model_dir))  # fmt: skip
    sender = WeightSender(config, lambda: lora.adapter_tensors(model, gpt.shape).items(), sender=True)
    size = sum(t.numel() * t.element_size() for t in lora.adapter_tensors(model, gpt.shape).values())
    times, phases = [], []
    for rep in range(args.syncs + 1):
        version += 1
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("lora_B"):
                    param.normal_(0, 0.01)
        seconds = timed_sync(sender, version, folder)
        if rep:
            times.append(seconds)
            phases.append(sender.timings)
    sender.close()
    print(f"LoRA rank {args.lora_rank}: {[round(t * 1e3, 1) for t in times]} ms", flush=True)
    return size, times, phases


def train_step(model, optimizer, vocab_size: int, tokens: int = 512) -> None:
    """One optimizer step: the log-likelihood of random tokens, as an RL step moves every weight a little."""
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (1, tokens + 1), device=device)
    positions = torch.arange(tokens, device=device).unsqueeze(0)
    logits = model(input_ids=ids[:, :-1], position_ids=positions, attention_mask=None)
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def check(url: str, model, gpt, version: int) -> None:
    """The engine serves `version` with exactly the trainer's weights (first rows of a few tensors)."""
    from services.trainer.models import hf_weights_of

    info = httpx.get(f"{url}/model_info", timeout=30).json()
    assert info["weight_version"] == str(version), info
    wanted = {"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"}
    for name, tensor in hf_weights_of(model, gpt):
        if name in wanted:
            got = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 2}, timeout=60).json()
            assert torch.equal(torch.tensor(got), tensor[:2].float().cpu()), name


def report(args, size: int, count: int, raw: list[float], rows: list, adapters: tuple | None = None) -> None:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    gb = size / 1e9
    best_raw = min(raw)
    route = "trainer and engine on GPU 0 (CUDA IPC)" if args.colocate else "trainer GPU 0 → engine GPU 1"
    print(f"\nWeight sync, {args.shape}: {gb:.2f} GB in {count} tensors; {route}; {device}; "
          f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    formats = f" --load-formats {' '.join(args.load_formats)}" if args.load_formats != ["per-tensor"] else ""
    formats += f" --buckets-in-flight {args.buckets_in_flight}" if args.buckets_in_flight != 2 else ""
    formats += " --streamed" if args.streamed else ""
    formats += " --colocate" if args.colocate else ""
    formats += " --mps" if args.mps else ""
    formats += f" --update-weight-mode {args.update_weight_mode}" if args.update_weight_mode != "full" else ""
    formats += f" --lr {args.lr:g}" if args.lr is not None else ""
    formats += f" --lora-rank {args.lora_rank}" if args.lora_rank else ""
    print(f"command: python bench/weight_sync.py --shape {args.shape} --bucket-mib "
          f"{' '.join(f'{mib:g}' for mib in args.bucket_mib)} --syncs {args.syncs}{formats}\n")  # fmt: skip
    print("| path | bucket | buckets | time (median, min) | GB/s (best) | share of raw (median, best) | "
          "prepare / send / commit (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    raw_median = statistics.median(raw)
    if not args.colocate:  # no broadcast to compare with on one GPU
        print(f"| raw NCCL broadcast | - | - | {raw_median * 1e3:.1f} ms, {best_raw * 1e3:.1f} ms | "
              f"{gb / best_raw:.1f} | 100% | - |")  # fmt: skip
    for mib, load_format, layout, times, phases in rows:
        parts = " / ".join(f"{statistics.median(p[k] for p in phases) * 1e3:.1f}"
                           for k in ("prepare_s", "send_s", "commit_s"))  # fmt: skip
        median = statistics.median(times)
        path = "streamed" if args.streamed else load_format
        share = "-" if args.colocate else f"{raw_median / median:.0%}, {best_raw / min(times):.0%}"
        print(f"| end to end, {path} | {mib:g} MiB | {len(layout)} | {median * 1e3:.1f} ms, "
              f"{min(times) * 1e3:.1f} ms | {gb / min(times):.1f} | {share} | {parts} ms |")  # fmt: skip
    if adapters is not None:
        lora_size, times, phases = adapters
        parts = " / ".join(f"{statistics.median(p[k] for p in phases) * 1e3:.1f}"
                           for k in ("prepare_s", "send_s", "commit_s"))  # fmt: skip
        full = min(statistics.median(times) for *_, times, _ in rows)
        print(f"| LoRA adapters, rank {args.lora_rank} ({lora_size / 1e6:.1f} MB, a peft folder the engine loads) | - "
              f"| - | {statistics.median(times) * 1e3:.1f} ms, {min(times) * 1e3:.1f} ms | - | "
              f"{statistics.median(times) / full:.1%} of the best full sync's median | {parts} ms |")  # fmt: skip
    if args.streamed:  # where the send's time went, on each side
        for mib, _, _, _, phases in rows:
            waits = " / ".join(f"{statistics.median(p.get(k, 0) for p in phases) * 1e3:.1f}"
                               for k in ("waited_s", "answers_s"))  # fmt: skip
            print(
                f"{mib:g} MiB, the trainer's send (median): waiting for broadcasts / for the last answers (the "
                f"commit with them, where the plan's answer carried it): {waits} ms"
            )
            if args.update_weight_mode == "delta":
                shares = [p["changed_words"] / p["words"] for p in phases if p.get("words")]
                print(f"{mib:g} MiB, words changed per sync (2-byte words; delta from the second sync on): "
                      + ", ".join(f"{share:.2%}" for share in shares))  # fmt: skip
        receiver = [line for line in (args.folder / "receiver.log").read_text().splitlines() if "loaded in" in line]
        print("the receiver's last syncs:\n" + "\n".join(line.split(": ", 1)[-1] for line in receiver[-4:]))


if __name__ == "__main__":
    main()
