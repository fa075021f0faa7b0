"""Weights into a running engine over NCCL: this process is the trainer (rank 0, GPU 1) and sends every parameter
of a Qwen3-0.6B-shaped model to a `slipstream engine` on GPU 0, once per tensor and once as a flattened bucket,
through SGLang's protocol (/init_weights_update_group, /begin_weight_update, /update_weights_from_distributed,
/end_weight_update). It checks the weights arrived bit-identical and the outputs changed. Needs 2 GPUs.

Run: python bench/engine_weights.py
"""

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from services.common.processes import free_port
from services.train.tiny_checkpoint import write_tiny_model
from services.weightsync.group import apply_nccl_settings, flatten, init_custom_process_group


def start_engine(model: Path) -> tuple[subprocess.Popen, str]:
    port, env = free_port(), dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    cmd = [
        sys.executable,
        "-m",
        "slipstream",
        "engine",
        "--model-path",
        str(model),
        "--port",
        str(port),
        "--device",
        "cuda",
    ]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("the engine did not become healthy")


def in_background(url: str, path: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url + path, json=body, timeout=600)))
    thread.start()
    return thread, result


def greedy(url: str) -> dict:
    body = {"text": "What is 1 + 2?", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=60).json()


def main() -> None:
    from transformers import AutoModelForCausalLM

    apply_nccl_settings()  # the weight group's, as the engine's
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / "model", num_layers=28, hidden_size=1024, intermediate_size=3072)
        proc, url = start_engine(path)
        try:
            torch.cuda.set_device(1)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
            port = free_port()
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "bench", "backend": "nccl"}  # fmt: skip
            thread, _ = in_background(url, "/init_weights_update_group", body)
            group = init_custom_process_group("nccl", f"tcp://127.0.0.1:{port}", 2, 0, "bench")
            thread.join()
            before = greedy(url)["output_ids"]
            torch.manual_seed(3)
            named = {name: torch.randn_like(p) * 0.05 for name, p in model.named_parameters()}
            size = sum(t.numel() * t.element_size() for t in named.values())
            rows = []
            for flat in (False, True):
                httpx.post(f"{url}/begin_weight_update", json={"selector": "all"})
                body = {"names": list(named), "dtypes": ["bfloat16"] * len(named), "group_name": "bench",
                        "shapes": [list(t.shape) for t in named.values()], "weight_version": f"v{int(flat)}",
                        "load_format": "flattened_bucket" if flat else None}  # fmt: skip
                thread, result = in_background(url, "/update_weights_from_distributed", body)
                torch.cuda.synchronize()
                start = time.perf_counter()
                tensors = [flatten(list(named.values()))] if flat else list(named.values())
                for tensor in tensors:
                    torch.distributed.broadcast(tensor, src=0, group=group)
                torch.cuda.synchronize()
                sent = time.perf_counter() - start
                thread.join()
                loaded = time.perf_counter() - start
                httpx.post(f"{url}/end_weight_update", json={})
                assert result["r"].json()["success"], result["r"].text
                rows.append(("flattened bucket" if flat else "per tensor", sent, loaded))
            sample = list(named)[:8]
            identical = all(
                torch.equal(
                    torch.tensor(
                        httpx.post(f"{url}/get_weights_by_name", json={"name": n, "truncate_size": 10**9}).json()
                    ),
                    named[n].float().cpu(),
                )
                for n in sample
            )
            after = greedy(url)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{len(named)} tensors, {size / 2**30:.2f} GiB bf16, GPU 1 (this process) -> engine on GPU 0; "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("format | broadcast ms | until the engine answered ms | GiB/s (answered)")
    print("--- | --- | --- | ---")
    for name, sent, loaded in rows:
        print(f"{name} | {sent * 1000:.0f} | {loaded * 1000:.0f} | {size / 2**30 / loaded:.1f}")
    print(f"\nbit-identical ({len(sample)} tensors read back): {identical}; greedy output changed: "
          f"{after['output_ids'] != before}; weight_version: {after['meta_info']['weight_version']}")  # fmt: skip
    print("Reproduce: python bench/engine_weights.py  (2 GPUs)")


if __name__ == "__main__":
    main()
