"""Soak: one long `slipstream train` run with survivable faults injected over and over (reward workers SIGKILLed and
SIGSTOPped, engines SIGSTOPped for longer than their health checks allow and let go), while the long-lived processes'
memory (RSS) and open file descriptors are sampled. After a warm-up minute they must stay flat: RSS within 20 % +
64 MiB of the warm-up's, descriptors within 16. `make test-faults SOAK_MINUTES=30` (skipped without the option)."""

import os
import random
import signal
import time
from pathlib import Path

import pytest

from services.train.demo import train_args
from tests.faults.test_faults import find, resume_signal
from tests.test_train import steps_of, wait_gone

pytestmark = pytest.mark.faults
LONG_LIVED = ("redis", "buffer", "rollout", "reward", "trainer")


def usage(pid: int) -> tuple[float, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(0)  # as long as --soak-minutes says
def test_memory_and_open_files_stay_flat_under_repeated_faults(service_process, tmp_path, request):
    minutes = request.config.getoption("--soak-minutes")
    if not minutes:
        pytest.skip("pass --soak-minutes N (make test-faults SOAK_MINUTES=N)")
    rng = random.Random(0)
    args = [*train_args(tmp_path, steps=100_000), "--rollout-num-gpus", "2", "--save-interval", "50",
            "--rm-timeout-s", "3", "--rollout-health-check-timeout", "3", "--rollout-health-check-interval", "1",
            "--eval-interval", "1000000"]  # fmt: skip
    run_dir = tmp_path / "demo"
    run = service_process("train", *args)
    deadline = time.monotonic() + 600
    while len(steps_of(run_dir)) < 2:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.log[-3000:]
        time.sleep(0.5)
    pids = {name: find(run_dir, name, run.proc.pid, rng) for name in LONG_LIVED}
    end, warm, faults = time.monotonic() + minutes * 60, None, 0
    while time.monotonic() < end:
        assert run.proc.poll() is None, run.log[-3000:]
        kind = rng.choice(["reward-worker-kill", "reward-worker-stop", "engine-stop"])
        victim = find(run_dir, "engine" if kind == "engine-stop" else "reward-worker", run.proc.pid, rng)
        os.kill(victim, signal.SIGKILL if kind.endswith("kill") else signal.SIGSTOP)
        time.sleep(8 if kind == "engine-stop" else 4)
        resume_signal(victim)
        faults += 1
        time.sleep(rng.uniform(5, 15))
        if warm is None and time.monotonic() > end - minutes * 60 + 60:
            warm = {name: usage(pid) for name, pid in pids.items()}
    final = {name: usage(pid) for name, pid in pids.items()}
    steps = len(steps_of(run_dir))
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(180) == 130
    assert wait_gone(run_dir, timeout_s=60) == []
    print(f"\nsoak: {minutes:g} min, {faults} faults, {steps} steps; (RSS MiB, fds) warm {warm} final {final}")
    assert steps > 2, "the run stopped making progress"
    for name in LONG_LIVED:
        (rss0, fds0), (rss1, fds1) = warm[name], final[name]
        assert rss1 <= rss0 * 1.2 + 64, (name, rss0, rss1)
        assert fds1 <= fds0 + 16, (name, fds0, fds1)
