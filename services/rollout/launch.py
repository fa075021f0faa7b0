"""Processes the gateway starts itself: engines for `--rollout-num-gpus` (SGLang servers when SGLang is installed,
else reference engines), each with its weight receiver beside it under --weight-receiver-port-offset, and the
sglang-router for `--use-router`. Each one logs to `--engine-log-dir`, dies with the
gateway (even when the gateway is SIGKILLed) and is stopped with it (services/common/launch.py)."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import aiohttp

from services.common.errors import StartupError
from services.common.launch import Child, num_gpus, start, stop, wait_ready
from services.common.processes import free_port, free_port_pair
from services.rollout import adapters
from services.rollout.config import RolloutConfig


async def launch_engines(config: RolloutConfig, name: str = "engine", first_gpu: int = 0) -> list[Child]:
    """Starts `--rollout-num-gpus / --rollout-num-gpus-per-engine` engines (from GPU `first_gpu` on) and waits until
    each one is healthy."""
    per_engine = config.rollout_num_gpus_per_engine
    gpus = num_gpus()
    if gpus and gpus < first_gpu + config.rollout_num_gpus:
        raise StartupError(f"{first_gpu + config.rollout_num_gpus} GPUs for the engines, but this machine has {gpus}")
    children = []
    offset = config.weight_receiver_port_offset
    for index in range(config.rollout_num_gpus // per_engine):
        port = free_port() if offset is None else free_port_pair(offset)
        # Placed by SGLang's --base-gpu-id, every engine seeing the node's GPUs as the trainer does: colocated, it
        # reads the tensor handles of the trainer rank on its GPU (on CPU, engine i those of local rank i).
        gpu = first_gpu + index * per_engine
        args = engine_command(config, port, per_engine, on_gpu=bool(gpus), base_gpu_id=gpu)
        children.append(start(f"{name}-{index}", args, port, Path(config.engine_log_dir)))
        if offset is not None:  # its weight receiver, beside it
            args = receiver_command(config, port, per_engine, bool(gpus), gpu)
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
    common += adapters.server_options(config)
    if config.engine_api_key_file is not None and "--api-key" not in config.sglang_args:
        common += ["--api-key", config.engine_api_key()]
    if importlib.util.find_spec("sglang") is not None:
        return [sys.executable, "-m", "sglang.launch_server", *common, "--tp-size", str(tp_size), *config.sglang_args]
    if tp_size > 1:
        raise StartupError("the reference engine runs without tensor parallelism; set --rollout-num-gpus-per-engine 1")
    device = ["--device", "cuda"] if on_gpu else []
    disk = ["--weight-disk-dir", config.update_weight_disk_dir] if config.update_weight_disk_dir else []
    return [sys.executable, "-m", "services.engine", *common, *device, *disk, *config.sglang_args]


def receiver_command(config: RolloutConfig, engine_port: int, tp_size: int, on_gpu: bool, base_gpu_id: int) -> list:
    """`slipstream receiver` for the engine on `engine_port`, on its port + --weight-receiver-port-offset."""
    port = engine_port + config.weight_receiver_port_offset
    args = ["--engine-url", f"http://127.0.0.1:{engine_port}", "--port", str(port),
            "--device", "cuda" if on_gpu else "cpu", "--base-gpu-id", str(base_gpu_id), "--tp-size", str(tp_size),
            "--timeout-s", str(config.weight_sync_timeout_s)]  # fmt: skip
    if config.engine_api_key_file is not None:  # the key from its file, on no command line; the gateway sends it
        key = str(config.engine_api_key_file)
        args += ["--engine-api-key-file", key, "--api-key-file", key]
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


async def launch_teachers(config: RolloutConfig) -> list[Child]:
    """On-policy distillation's teacher engines (--opd-teacher-hf-checkpoint), on the GPUs after the policy's."""
    if not config.opd_teacher_hf_checkpoint:
        return []
    teacher = config.model_copy(
        update={"hf_checkpoint": config.opd_teacher_hf_checkpoint, "rollout_num_gpus": config.opd_teacher_num_gpus,
                "weight_receiver_port_offset": None, "update_weight_disk_dir": None,
                "use_rollout_routing_replay": False}
    )  # fmt: skip
    return await launch_engines(teacher, "teacher", first_gpu=config.rollout_num_gpus)
