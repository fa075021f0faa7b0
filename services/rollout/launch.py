"""Processes the gateway starts itself: engines for `--rollout-num-gpus` (SGLang servers when SGLang is installed,
else reference engines), each with its weight receiver beside it under --weight-receiver-port-offset, and the
sglang-router for `--use-router`. Each one logs to `--engine-log-dir`, dies with the
gateway (even when the gateway is SIGKILLed) and is stopped with it."""

import asyncio
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from services.common.errors import StartupError
from services.common.processes import die_with_parent, free_port, free_port_pair
from services.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


@dataclass
class Child:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 8) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start(name: str, args: list[str], port: int, log_dir: Path, env: dict | None = None) -> Child:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    # No Python may run in the child between fork and exec (preexec_fn) once gRPC's threads run in this process:
    # gRPC's fork handlers can abort the child. setpriv ties the child to this process without that.
    setpriv = shutil.which("setpriv")
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            [setpriv, "--pdeathsig", "TERM", "--", *args] if setpriv else args, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=None if setpriv else die_with_parent,
        )  # fmt: skip
    log.info("%s starting on port %d (log %s)", name, port, log_path)
    return Child(name, f"http://127.0.0.1:{port}", proc, log_path)


async def wait_ready(child: Child, path: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until `child` answers 200 on `path`; a child that exits first is a StartupError with its log's tail."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while asyncio.get_running_loop().time() < deadline:
            if child.proc.poll() is not None:
                raise StartupError(
                    f"{child.name} exited with code {child.proc.returncode} while starting; its log "
                    f"{child.log_path} ends with:\n{child.tail()}"
                )
            try:
                async with session.get(f"{child.url}{path}") as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
    raise StartupError(f"{child.name} did not answer {path} within {timeout_s:.0f} s; see {child.log_path}")


async def stop(children: list[Child], grace_s: float = 10.0) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    for child in children:
        try:
            await asyncio.to_thread(child.proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait)


async def launch_engines(config: RolloutConfig) -> list[Child]:
    """Starts `--rollout-num-gpus / --rollout-num-gpus-per-engine` engines and waits until each one is healthy."""
    per_engine = config.rollout_num_gpus_per_engine
    gpus = num_gpus()
    if gpus and gpus < config.rollout_num_gpus:
        raise StartupError(f"--rollout-num-gpus {config.rollout_num_gpus} but this machine has {gpus} GPU(s)")
    children = []
    offset = config.weight_receiver_port_offset
    for index in range(config.rollout_num_gpus // per_engine):
        port = free_port() if offset is None else free_port_pair(offset)
        # Placed by SGLang's --base-gpu-id, every engine seeing the node's GPUs as the trainer does: colocated, it
        # reads the tensor handles of the trainer rank on its GPU (on CPU, engine i those of local rank i).
        args = engine_command(config, port, per_engine, on_gpu=bool(gpus), base_gpu_id=index * per_engine)
        children.append(start(f"engine-{index}", args, port, Path(config.engine_log_dir)))
        if offset is not None:  # its weight receiver, beside it
            args = receiver_command(config, port, per_engine, bool(gpus), index * per_engine)
            children.append(start(f"receiver-{index}", args, port + offset, Path(config.engine_log_dir)))
    try:
        await asyncio.gather(*(wait_ready(c, "/health") for c in children))
    except StartupError:
        await stop(children)
        raise
    return children


def engine_command(config: RolloutConfig, port: int, tp_size: int, on_gpu: bool, base_gpu_id: int = 0) -> list[str]:
    """`python -m sglang.launch_server …` when SGLang is installed, else the reference engine; --sglang-* options
    are passed to either as given."""
    common = ["--model-path", config.hf_checkpoint, "--host", "127.0.0.1", "--port", str(port)]
    common += ["--base-gpu-id", str(base_gpu_id)]
    common += ["--enable-return-routed-experts"] if config.use_rollout_routing_replay else []
    if config.engine_api_key_file is not None and "--api-key" not in config.sglang_args:
        common += ["--api-key", config.engine_api_key()]
    if importlib.util.find_spec("sglang") is not None:
        return [sys.executable, "-m", "sglang.launch_server", *common, "--tp-size", str(tp_size), *config.sglang_args]
    if tp_size > 1:
        raise StartupError("the reference engine runs without tensor parallelism; set --rollout-num-gpus-per-engine 1")
    device = ["--device", "cuda"] if on_gpu else []
    return [sys.executable, "-m", "services.rollout.engine", *common, *device, *config.sglang_args]


def receiver_command(config: RolloutConfig, engine_port: int, tp_size: int, on_gpu: bool, base_gpu_id: int) -> list:
    """`slipstream receiver` for the engine on `engine_port`, on its port + --weight-receiver-port-offset."""
    port = engine_port + config.weight_receiver_port_offset
    args = ["--engine-url", f"http://127.0.0.1:{engine_port}", "--port", str(port),
            "--device", "cuda" if on_gpu else "cpu", "--base-gpu-id", str(base_gpu_id), "--tp-size", str(tp_size),
            "--timeout-s", str(config.weight_sync_timeout_s)]  # fmt: skip
    if config.engine_api_key_file is not None:
        args += ["--engine-api-key", config.engine_api_key()]
    return [sys.executable, "-m", "services.receiver", *args]


async def launch_router(config: RolloutConfig) -> Child:
    """Starts an sglang-router without workers: the engine pool adds each engine it admits and removes each one it
    evicts."""
    port = free_port()
    args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--log-level", "warn", "--prometheus-port", str(free_port())]  # fmt: skip
    if importlib.util.find_spec("sglang_router") is None:
        raise StartupError("--use-router needs the sglang-router package: pip install sglang-router")
    child = start("router", args, port, Path(config.engine_log_dir))
    try:
        await wait_ready(child, "/workers", timeout_s=120)
    except StartupError:
        await stop([child])
        raise
    return child


async def wait_workers(router: Child, urls: list[str], timeout_s: float = 60.0) -> None:
    """Waits until the router lists every engine in `urls` as a healthy worker."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while asyncio.get_running_loop().time() < deadline:
            async with session.get(f"{router.url}/workers") as response:
                workers = (await response.json())["workers"]
            if set(urls) <= {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}:
                return
            await asyncio.sleep(0.2)
    raise StartupError(f"the router did not take the engines {urls} within {timeout_s:.0f} s; see {router.log_path}")


def gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA names them to a child process: CUDA_VISIBLE_DEVICES's entries up to the
    first hidden one ("-1" or empty), else every GPU of the machine; none without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
        return [str(i) for i in range(sum(line.startswith("GPU ") for line in result.stdout.splitlines()))]
    ids = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry in ("", "-1"):
            break
        ids.append(entry)
    return ids


def num_gpus() -> int:
    """How many GPUs this process may use (none where CUDA_VISIBLE_DEVICES hides them all: a CPU run)."""
    return len(gpu_ids())
