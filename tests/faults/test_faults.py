"""Faults injected into a real `slipstream train` run (every service a process, the embedded Redis, two reference
engines): SIGKILL and SIGSTOP (a hung peer) of each kind of process, at a step picked by the case's seed. After each:

- the run either finishes, or stops with a message naming the failed part and then finishes when resumed with
  --load (the expected outcome of each case is stated in CASES, and in docs/RELIABILITY.md);
- the lineage of trained steps holds every prompt group exactly once (none trained twice, none lost);
- policy versions only go up;
- the buffer's state in Redis passes its invariants check.

`make test` runs the cases in IN_MAKE_TEST; `make test-faults` runs them all (the others are marked `faults`), and
with `SOAK_MINUTES=N` also the soak, which repeats faults for N minutes and checks that the long-lived services'
memory and open files stay flat (tests/faults/test_soak.py)."""

import asyncio
import contextlib
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.buffer.store import BufferStore
from services.common.redis_connection import EmbeddedRedis
from services.train.demo import train_args
from tests.test_train import processes_of, steps_of, wait_gone

STEPS, SAVE_INTERVAL, BATCH = 8, 2, 32
pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Case:
    target: str  # which process: see find()
    sig: int
    survives: bool  # the run finishes by itself; else it stops naming `named` and a resume finishes it
    named: str = ""
    flags: tuple = ()


REDIS_DOWN = "Redis does not answer"  # the buffer's answer, which the rollout service logs
CASES = {
    "redis-everysec-sigkill": Case("redis", signal.SIGKILL, False, REDIS_DOWN),
    "redis-always-sigkill": Case("redis", signal.SIGKILL, False, REDIS_DOWN, ("--redis-appendfsync", "always")),
    "redis-sigstop": Case("redis", signal.SIGSTOP, False, REDIS_DOWN),
    "buffer-sigkill": Case("buffer", signal.SIGKILL, False, "the buffer service exited"),
    "buffer-sigstop": Case("buffer", signal.SIGSTOP, False, "the buffer service does not answer"),
    "gateway-sigkill": Case("rollout", signal.SIGKILL, False, "the rollout service exited"),
    "gateway-sigstop": Case("rollout", signal.SIGSTOP, False, "the rollout service does not answer"),
    "reward-service-sigkill": Case("reward", signal.SIGKILL, False, "the reward service exited"),
    "reward-service-sigstop": Case("reward", signal.SIGSTOP, False, "the reward service does not answer"),
    "reward-worker-sigkill": Case("reward-worker", signal.SIGKILL, True),
    "reward-worker-sigstop": Case("reward-worker", signal.SIGSTOP, True),
    "engine-sigkill": Case("engine", signal.SIGKILL, True),
    "engine-sigstop": Case("engine", signal.SIGSTOP, True),
    "trainer-sigkill": Case("trainer", signal.SIGKILL, False, "the trainer service exited"),
    "trainer-sigstop": Case("trainer", signal.SIGSTOP, False, "the trainer service does not answer"),
    "launcher-sigkill": Case("launcher", signal.SIGKILL, False),
    "launcher-sigstop": Case("launcher", signal.SIGSTOP, True),
}
# The case `make test` runs (about a minute on 2 cores): a fault no other test of `make test` shows in a whole run. A
# hung reward worker is replaced in tests/reward/test_service.py; the Redis cases wait out the stall timeout before the
# resume (2 minutes each): `make test-faults` runs them all.
IN_MAKE_TEST = {"engine-sigstop"}
FAULTS = pytest.mark.faults
MODULES = {"buffer": "services.buffer", "rollout": "services.rollout", "reward": "services.reward",
           "engine": "services.engine", "trainer": "services.trainer"}  # fmt: skip


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def find(run_dir: Path, target: str, launcher: int, rng: random.Random) -> int:
    """The pid of one process of kind `target` in the run (one of several picked by `rng`)."""
    if target == "launcher":
        return launcher
    pids = processes_of(run_dir)
    if target == "redis":  # the buffer's child; Redis rewrites its title over its environment, run marker included
        buffer = next(p for p in pids if len(argv(p)) > 2 and argv(p)[2] == MODULES["buffer"])
        children = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and parent(int(e.name)) == buffer]
        found = [p for p in children if argv(p) and "redis-server" in argv(p)[0]]
    elif target == "reward-worker":  # the reward service's worker processes (multiprocessing's spawn), not its tracker
        service = next(p for p in pids if MODULES["reward"] in argv(p)[1:3])
        found = [p for p in pids if parent(p) == service and any("spawn_main" in a for a in argv(p))]
    else:
        found = [p for p in pids if len(argv(p)) > 2 and argv(p)[2] == MODULES[target]]
    assert found, f"no {target} process in the run"
    return rng.choice(sorted(found))


def wait_for_step(run, run_dir: Path, step: int, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps_of(run_dir)) < step and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.proc.poll() is None and len(steps_of(run_dir)) >= step, run.log[-3000:]


def check_invariants(run_dir: Path, runs: list[list[dict]], redis_url: str | None = None) -> None:
    """`redis_url`: the run's Redis when it is not the embedded one in the run's folder."""
    for steps in runs:  # policy versions only go up within each run, and the steps follow each other
        versions = [s["policy_version"] for s in steps]
        assert versions == sorted(set(versions)), versions
    resumed_at = runs[-1][0]["step"] if len(runs) > 1 and runs[-1] else STEPS
    lineage = [s for s in runs[0] if s["step"] < resumed_at] + (runs[-1] if len(runs) > 1 else [])
    assert [s["step"] for s in lineage] == list(range(STEPS)), [s["step"] for s in lineage]
    versions = [s["policy_version"] for s in lineage]  # and across the resume
    assert versions == sorted(set(versions)), versions
    trained = [gid for s in lineage for gid in s["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * BATCH, "a prompt group was trained twice or lost"
    violations, status, version = buffer_record(run_dir, redis_url)
    assert violations == []
    # The buffer's record agrees: each group trained at its lineage step, and no other; none generated in vain.
    assert {gid: s for gid, s in status.items() if s.startswith("trained:")} == {
        gid: f"trained:{s['step']}" for s in lineage for gid in s["groups"]}  # fmt: skip
    assert "dropped:stale" not in status.values()
    assert version == lineage[-1]["policy_version"]


def buffer_record(run_dir: Path, redis_url: str | None = None) -> tuple[list[str], dict[str, str], int]:
    """The buffer's state in Redis after the run: its invariants' violations, each group's status, the policy
    version."""
    server = EmbeddedRedis(run_dir / "redis").start() if redis_url is None else None

    async def read():
        from redis.asyncio import Redis

        redis = Redis.from_url(redis_url or server.url)
        store = BufferStore(redis, "slipstream", run_dir.name)
        try:
            status = {k.decode(): v.decode() for k, v in (await redis.hgetall(store.key("status"))).items()}
            return await store.violations(), status, await store.meta_int("policy_version", 0)
        finally:
            await redis.aclose()

    try:
        return asyncio.run(read())
    finally:
        if server is not None:
            server.stop()


def resume_signal(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in IN_MAKE_TEST else FAULTS) for n in CASES])
def test_a_fault_is_survived_or_named_and_nothing_is_lost(service_process, tmp_path, name):
    case, rng = CASES[name], random.Random(name)
    args = [*train_args(tmp_path, steps=STEPS), "--save-interval", str(SAVE_INTERVAL), "--rollout-num-gpus", "2",
            "--stall-timeout-s", "60", "--rm-timeout-s", "5", "--rollout-health-check-timeout", "5",
            "--rollout-health-check-interval", "1", "--weight-sync-timeout-s", "20", *case.flags]  # fmt: skip
    run_dir = tmp_path / "demo"
    first = service_process("train", *args)
    wait_for_step(first, run_dir, rng.randint(3, 5))  # after the first checkpoint (step 2)
    victim = find(run_dir, case.target, first.proc.pid, rng)
    os.kill(victim, case.sig)
    if case.target == "launcher" and case.sig == signal.SIGSTOP:
        time.sleep(rng.uniform(2, 8))  # hung for a while: its services carry on, then it catches up
        resume_signal(victim)
    try:
        code = first.wait(600)
    finally:
        resume_signal(victim)  # a stopped process is let go, so that it can be stopped
    runs = [steps_of(run_dir)]
    if case.survives:
        assert code == 0, first.log[-3000:]
    else:
        assert code != 0, first.log[-3000:]
        if case.named:  # in the run's last words
            assert case.named in first.log[first.log.rindex("slipstream train:") :], first.log[-3000:]
        assert wait_gone(run_dir, timeout_s=60) == []
        second = service_process("train", *args, "--load", str(run_dir / "checkpoints"))
        assert second.wait(600) == 0, second.log[-3000:]
        runs.append(steps_of(run_dir)[len(runs[0]) :])
    assert wait_gone(run_dir, timeout_s=60) == []
    check_invariants(run_dir, runs)
