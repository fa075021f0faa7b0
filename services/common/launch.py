"""Processes a service starts and serves beside it (the gateway's engines, weight receivers and router; the services
of `slipstream train`): each logs to its own file, dies with the process that started it (even when that one is
SIGKILLed), is waited on until it answers, and is stopped with it; and the GPUs this process may give them."""

import asyncio
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import StartupError
from services.common.processes import tied_to_parent

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
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            **tied_to_parent(args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    log.info("%s starting on port %d (log %s)", name, port, log_path)
    return Child(name, f"http://127.0.0.1:{port}", proc, log_path)


async def wait_ready(child: Child, path: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until `child` answers 200 on `path`; a child that exits first is a StartupError with its log's tail."""
    import aiohttp  # here: `slipstream train`, which starts gRPC services, has no use for it

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
            child.proc.send_signal(signal.SIGCONT)  # as systemd does: a stopped child gets its SIGTERM now
    for child in children:
        try:
            await asyncio.to_thread(child.proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait)


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
