"""CUDA graphs of the decode step, as SGLang runs its decode by default (`--disable-cuda-graph` turns them off).

A small model's decode step is bound by the host: a thousand kernel launches and the Python around them, for a few
milliseconds of GPU work. A graph captured once per batch row count replays all of them in one launch. The step reads
its inputs from tensors at fixed addresses (services/engine/batch.py), so a replay computes exactly what the eager step
would. A graph holds the addresses of the weights and the KV cache, so the batcher drops the graphs where either
moves: a memory release (a colocated engine's weights come back elsewhere) and a cache that grows; weight updates
copy into the weights in place. The first step of a row count runs eagerly, which warms it up (lazy initialisations
happen outside the capture) and spares a capture to a row count that comes once; the second captures it. A model
whose step cannot be captured (one that reads a device value on the host, such as transformers' MoE layers choosing
experts) runs eagerly.
"""

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def bucket(count: int) -> int:
    """The batch size a decode step of `count` sequences runs at: a power of two up to 32, then a multiple of 32
    (SGLang's buckets are alike), so that a few dozen graphs serve every size and padding wastes little."""
    if count <= 32:
        return 1 << max(count - 1, 0).bit_length()
    return -(-count // 32) * 32


class DecodeGraphs:
    def __init__(self, device: torch.device, max_rows: int):
        self.device, self.max_rows = device, max_rows
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool = None  # one memory pool for all graphs: they replay one at a time, their outputs read at once
        self.seen: set[int] = set()  # row counts run since the graphs were last dropped
        self.failed = False
        self.captures = 0

    def run(self, rows: int, step: Callable[[], Any]) -> Any:
        """`step()`'s result, from the graph of `rows` rows (captured at its second use)."""
        if self.device.type != "cuda" or self.failed or rows > self.max_rows:
            return step()
        if rows not in self.graphs:
            if rows not in self.seen:  # a first step of this many rows runs eagerly: its warm-up, and no capture
                self.seen.add(rows)  # for a row count that comes once (a colocated engine's every step starts anew)
                return step()
            try:
                self.graphs[rows] = self._capture(step)
            except Exception as e:  # any failure to capture leaves the eager step, which is exact
                log.warning("decode runs without CUDA graphs: capturing it failed (%s: %s)", type(e).__name__, e)
                self.failed = True
                self.clear()
                return step()
        graph, outputs = self.graphs[rows]
        graph.replay()
        return outputs

    def _capture(self, step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """The step's graph; the step ran eagerly once before with these shapes (lazy initialisations are done)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = step()
        self.captures += 1
        return graph, outputs

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.pool = None
