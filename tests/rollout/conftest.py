"""Rollout fixtures: a tiny Qwen3 checkpoint and real `slipstream engine` processes serving it."""

import socket
import time

import httpx
import pytest

from services.common.tiny_checkpoint import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


def wait_healthy(proc, url: str) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            pytest.fail(f"engine exited with {proc.proc.returncode}:\n{proc.log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"engine never became healthy:\n{proc.log}")


@pytest.fixture(scope="module")
def engine_url(tiny_model, tmp_path_factory):
    """One real engine process shared by a test module (starting one costs seconds)."""
    from tests.conftest import ServiceProcess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = ServiceProcess(["engine", "--model-path", str(tiny_model), "--port", str(port)], log, log.parent)
    try:
        yield wait_healthy(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.stop()


@pytest.fixture
def start_engine(service_process, free_port, tiny_model):
    """`url = start_engine()`: a real engine process of its own on a free port (or `port=`), ready (/health answered
    200); `start_engine.procs[url]` is its process."""

    def start(*args: str, port: int | None = None) -> str:
        port = port or free_port()
        proc = service_process("engine", "--model-path", str(tiny_model), "--port", str(port), *args)
        url = wait_healthy(proc, f"http://127.0.0.1:{port}")
        start.procs[url] = proc
        return url

    start.procs = {}
    return start

    return start


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The same tiny model in this process, for reference outputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-ref"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
