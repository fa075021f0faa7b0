"""Remote reward models against real local servers: the example HTTP server (slime's remote_rm format, with
retries through its warm-up failures) and the example gRPC RewardService."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reward.conftest import score

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "external_reward_server"


@pytest.fixture
def example_server(free_port):
    started = []

    def start(name: str, *args: str) -> int:
        port = free_port()
        cmd = [sys.executable, str(EXAMPLES / name), "--host", "127.0.0.1", "--port", str(port), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert "listening" in proc.stdout.readline()
        return port

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(10)


def test_http_reward_model_with_retries(reward_service, example_server):
    port = example_server("http_server.py", "--fail-first", "2")
    stub = reward_service(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{port}/score", rm_retry_backoff_s=0.05)
    results = score(stub, ("the total is 12", "12"), ("the total is 13", "12"))
    assert [r.reward for r in results] == [1.0, 0.0], results
    assert results[0].details["length"] == len("the total is 12")


def test_http_reward_model_that_stays_down_gives_error_results(reward_service, free_port):
    url = f"http://127.0.0.1:{free_port()}/score"
    stub = reward_service(rm_type="remote_rm", rm_url=url, rm_max_retries=2, rm_retry_backoff_s=0.05)
    start = time.monotonic()
    (result,) = score(stub, ("12", "12"))
    assert result.error and f"remote reward model {url} failed 3 times" in result.error_message
    assert time.monotonic() - start < 10


def test_grpc_reward_service(reward_service, example_server):
    port = example_server("grpc_server.py")
    stub = reward_service(rm_type="remote_grpc", rm_grpc_addr=f"127.0.0.1:{port}")
    results = score(stub, ("so it is 7", "7"), ("so it is 8", "7"), (b"7 \xff", "7"))
    assert [r.item_id for r in results] == ["i0", "i1", "i2"]
    assert results[0].details["correct"] == 1.0 and results[1].details["correct"] == 0.0
    assert results[2].details["correct"] == 1.0  # the invalid byte reached the remote server and was replaced there
    assert results[0].reward == pytest.approx(1.0 - len("so it is 7") / 10_000)
