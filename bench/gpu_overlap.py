"""Whether a copy on the receiving GPU overlaps an NCCL receive: the question behind the streamed weight sync, where
the weight receiver (NCCL) and the engine (its copy into the parameters, SGLang's /update_weights_from_ipc) are two
processes on one GPU.

GPU 0 broadcasts 16 buckets of 512 MiB (8 GiB) to GPU 1, three receive slots; meanwhile 16 copies of 512 MiB run on
GPU 1, either in another process, each waited for as an engine loading a bucket does ("other process"), or in the
receiving process on a side stream, waited for once ("same process"), by a kernel (`torch._foreach_copy_`) or by
`cudaMemcpyAsync` (`copy_` of contiguous tensors of one dtype). Each figure is the median of 8 rounds after a warm-up.
Run it under an MPS control daemon (`nvidia-cuda-mps-control -d`, with CUDA_MPS_PIPE_DIRECTORY set for both) to
compare.

Run (2 GPUs): python bench/gpu_overlap.py
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.processes import free_port

BUCKETS, BUCKET_BYTES, SLOTS, ROUNDS = 16, 512 << 20, 3, 8
# (name, where the copies run, how): None where no copies run beside the broadcast
CASES = [
    ("broadcast alone", None, None),
    ("copies in another process, kernel", "other", "kernel"),
    ("copies in another process, memcpy", "other", "memcpy"),
    ("copies in the same process, side stream, kernel", "same", "kernel"),
    ("copies in the same process, side stream, memcpy", "same", "memcpy"),
]


def _buffer() -> torch.Tensor:
    return torch.empty(BUCKET_BYTES, dtype=torch.uint8, device="cuda")


def _copy(how: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if how == "kernel":
        torch._foreach_copy_([dst], [src])
    else:
        dst.copy_(src)


def _pair(rank: int, port: int, barrier, results) -> None:
    """Rank 0 (GPU 0) broadcasts, rank 1 (GPU 1) receives; rank 1 also copies where a case says "same"."""
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
    slots = [_buffer() for _ in range(SLOTS)]
    src, dst = _buffer(), _buffer()
    side = torch.cuda.Stream()
    for name, where, how in CASES:
        broadcasts, copies = [], []
        for _ in range(ROUNDS + 1):
            barrier.wait()
            torch.cuda.synchronize()
            started = time.perf_counter()
            works = [dist.broadcast(slots[i % SLOTS], src=0, async_op=True) for i in range(BUCKETS)]
            if rank == 1 and where == "same":
                with torch.cuda.stream(side):
                    for _ in range(BUCKETS):
                        _copy(how, dst, src)
                side.synchronize()
                copies.append(time.perf_counter() - started)
            for work in works:
                work.wait()
            torch.cuda.synchronize()
            broadcasts.append(time.perf_counter() - started)
            barrier.wait()
        if rank == 0:
            results.put((name, "broadcast", statistics.median(broadcasts[1:])))
        if copies:
            results.put((name, "copies", statistics.median(copies[1:])))
    dist.destroy_process_group()


def _copier(barrier, results) -> None:
    """Another process on GPU 1: copies where a case says "other", else only keeps step with the pair."""
    torch.cuda.set_device(1)
    src, dst = _buffer(), _buffer()
    for name, where, how in CASES:
        copies = []
        for _ in range(ROUNDS + 1):
            barrier.wait()
            started = time.perf_counter()
            if where == "other":
                for _ in range(BUCKETS):
                    _copy(how, dst, src)
                    torch.cuda.synchronize()
                copies.append(time.perf_counter() - started)
            barrier.wait()
        if copies:
            results.put((name, "copies", statistics.median(copies[1:])))
    for how in ("kernel", "memcpy"):  # alone, for reference
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(BUCKETS):
            _copy(how, dst, src)
        torch.cuda.synchronize()
        results.put((f"copies alone, {how}", "copies", time.perf_counter() - started))


def main() -> None:
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(3), context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_pair, args=(rank, port, barrier, results)) for rank in (0, 1)]
    processes.append(context.Process(target=_copier, args=(barrier, results)))
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        if process.exitcode:
            sys.exit(f"a benchmark process failed ({process.exitcode})")
    figures: dict[str, dict[str, float]] = {}
    while not results.empty():
        name, what, seconds = results.get()
        figures.setdefault(name, {})[what] = seconds * 1e3
    print(f"\nGPU 0 → GPU 1; {torch.cuda.get_device_name(0)}")
    print("command: python bench/gpu_overlap.py\n")
    bucket = f"{BUCKET_BYTES >> 20} MiB"
    print(f"| case | broadcast of {BUCKETS} buckets of {bucket} | {BUCKETS} copies of {bucket} on GPU 1 |")
    print("|---|---|---|")
    for name in [c[0] for c in CASES] + ["copies alone, kernel", "copies alone, memcpy"]:
        cells = [f"{figures[name][k]:.1f} ms" if k in figures.get(name, {}) else "-" for k in ("broadcast", "copies")]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
