"""The decode attention kernel alone (services/engine/paged_decode.py): microseconds a call and the memory bandwidth
it reaches reading a batch's keys and values from blocks scattered through the pool, for several tile sizes, warps,
pipeline stages and programs a multiprocessor. Qwen3-0.6B's attention shape by default (16 heads, 8 kv heads, 128).

Run (GPU):  python bench/paged_decode.py --rows 256 --length 1100
"""

import argparse
import itertools

import torch

from services.engine.paged_decode import PagedDecode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--length", type=int, default=1100, help="positions a sequence holds (each 50-150 %% of it)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    import triton.testing

    device = torch.device("cuda")
    lengths = torch.randint(args.length // 2, args.length * 3 // 2, (args.rows,), device=device)
    width = -(-int(lengths.max()) // args.block_size)
    tables = (torch.randperm(args.rows * width, device=device) + 1).view(args.rows, width).to(torch.int32)
    slots = (args.rows * width + 1) * args.block_size
    keys, values = (torch.randn(slots, args.kv_heads, args.dim, device=device, dtype=torch.bfloat16) for _ in "kv")
    query = torch.randn(args.rows, args.heads, args.dim, device=device, dtype=torch.bfloat16)
    rows = torch.arange(args.rows, device=device)
    moved = 2 * int(lengths.sum()) * args.kv_heads * args.dim * 2
    print(f"{args.rows} rows, {args.length} positions on average, {args.heads}/{args.kv_heads} heads of "
          f"{args.dim}, blocks of {args.block_size}: {moved / 1e6:.0f} MB of keys and values a call")  # fmt: skip
    print("tile | warps | stages | waves | splits | µs | GB/s")
    print("--- | --- | --- | --- | --- | --- | ---")
    for tile, warps, stages, waves in itertools.product([32, 64, 128], [4, 8], [1, 2, 3], [2, 8]):
        kernel = PagedDecode(device, tile, warps, stages, waves)
        try:
            ms = triton.testing.do_bench(lambda k=kernel: k(query, keys, values, tables, rows, lengths, args.block_size,
                                                              0.1))  # fmt: skip
        except Exception as e:  # a configuration that does not compile (shared memory)
            print(f"{tile} | {warps} | {stages} | {waves} | - | failed: {type(e).__name__} | -")
            continue
        splits = kernel.splits(args.rows, args.kv_heads)
        print(f"{tile} | {warps} | {stages} | {waves} | {splits} | {1000 * ms:.0f} | {moved / ms / 1e6:.0f}")
    print(f"\nReproduce: python bench/paged_decode.py --rows {args.rows} --length {args.length}")


if __name__ == "__main__":
    main()
