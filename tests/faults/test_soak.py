"""Soak: one long `slipstream train` run with survivable faults injected over and over (reward workers SIGKILLed and
SIGSTOPped, engines SIGSTOPped for longer than their health checks allow and let go), while the long-lived processes'
memory (RSS) and open file descriptors are sampled. After a warm-up minute they must stay flat: each process's RSS
within 20 % + 64 MiB of its warm-up sample, its descriptors within 16. `make soak` (30 minutes; SOAK_MINUTES=N for
another length); skipped without --soak-minutes."""

import os
import random
import signal
import time
from pathlib import Path

import pytest

from services.train.demo import train_args
from tests.faults.test_faults import MODULES, argv, find, resume_signal
from tests.test_train import processes_of, steps_of, wait_gone

pytestmark = pytest.mark.faults
WARM_UP_S = 60
RSS_FACTOR, RSS_SLACK_MB, FDS_SLACK = 1.2, 64, 16
FAULTS = ("reward-worker-kill", "reward-worker-stop", "engine-stop")


def usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def long_lived(run_dir: Path, launcher: int) -> dict[str, int]:
    """Name → pid of the processes that live as long as the run: Redis, every service, every engine."""
    rng = random.Random(0)  # one process of each kind but the engines, so the choice does not matter
    pids = {name: find(run_dir, name, launcher, rng) for name in ("redis", "buffer", "rollout", "reward", "trainer")}
    engines = sorted(p for p in processes_of(run_dir) if len(argv(p)) > 2 and argv(p)[2] == MODULES["engine"])
    pids.update({f"engine-{i}": pid for i, pid in enumerate(engines)})
    return pids


def inject(run_dir: Path, launcher: int, rng: random.Random) -> str:
    """One survivable fault, ended before this returns (a stopped process is let go)."""
    kind = rng.choice(FAULTS)
    target = "engine" if kind == "engine-stop" else "reward-worker"
    deadline = time.monotonic() + 60
    while True:  # a replaced reward pool starts its workers with its next item
        try:
            victim = find(run_dir, target, launcher, rng)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                log = (run_dir / "logs" / "reward.log").read_text(errors="replace")
                message = f"no {target} process for 60 s; the reward log ends with:\n{log[-3000:]}"
                raise AssertionError(message) from None
            time.sleep(0.5)
    os.kill(victim, signal.SIGKILL if kind.endswith("kill") else signal.SIGSTOP)
    time.sleep(8 if kind == "engine-stop" else 4)  # how long the fault lasts: an engine is evicted within 8 s
    resume_signal(victim)
    return kind


@pytest.mark.timeout(0)  # as long as --soak-minutes says
def test_memory_and_open_files_stay_flat_under_repeated_faults(service_process, tmp_path, request):
    minutes = request.config.getoption("--soak-minutes")
    if not minutes:
        pytest.skip("pass --soak-minutes N (make soak)")
    assert minutes * 60 >= 2 * WARM_UP_S, "--soak-minutes: at least 2 (a minute of warm-up, then the measured faults)"
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
    pids = long_lived(run_dir, run.proc.pid)
    started = time.monotonic()
    end, warm, faults = started + minutes * 60, None, []
    while time.monotonic() < end:
        assert run.proc.poll() is None, run.log[-3000:]
        faults.append(inject(run_dir, run.proc.pid, rng))
        time.sleep(rng.uniform(5, 15))  # the run recovers between faults
        if warm is None and time.monotonic() > started + WARM_UP_S:
            warm = {name: usage(pid) for name, pid in pids.items()}
            warm_steps = len(steps_of(run_dir))
    final = {name: usage(pid) for name, pid in pids.items()}
    steps = len(steps_of(run_dir))
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(180) == 130, run.log[-3000:]
    assert wait_gone(run_dir, timeout_s=60) == []
    print(f"\nsoak: {minutes:g} min, {len(faults)} faults ({', '.join(f'{faults.count(k)} {k}' for k in FAULTS)}), "
          f"steps {warm_steps} → {steps} after the warm-up")  # fmt: skip
    print(f"{'process':<10} {'RSS MiB warm':>12} {'final':>8} {'fds warm':>9} {'final':>6}")
    for name in pids:
        print(f"{name:<10} {warm[name][0]:>12.1f} {final[name][0]:>8.1f} {warm[name][1]:>9} {final[name][1]:>6}")
    assert steps > warm_steps, "the run stopped making progress"
    for name in pids:
        (rss0, fds0), (rss1, fds1) = warm[name], final[name]
        assert rss1 <= rss0 * RSS_FACTOR + RSS_SLACK_MB, (name, rss0, rss1)
        assert fds1 <= fds0 + FDS_SLACK, (name, fds0, fds1)
