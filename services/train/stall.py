"""Notices a run that makes no progress — no step, no weight sync, no sample generated or consumed — for
`--stall-timeout-s`, and says which part stalled, with the last error in its logs, so that a run never waits
silently until someone kills it."""

import re
import time
from pathlib import Path

# The trainer's phase → the services whose logs say why it waits, most likely first.
SUSPECTS = {
    "waiting_batch": ("rollout", "engine", "reward", "buffer"),
    "sync": ("trainer", "rollout", "engine"),
    "train": ("trainer",),
}
# Our services' log lines ("12:00:01 E name: …"), NCCL's warnings, and the last line of a Python traceback
# (a torchrun rank's prefixed with [rankN]).
ERRORS = re.compile(r"(^|\s)[EC] [\w.]+: |NCCL WARN|^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception): ")
LOG_PREFIX = re.compile(r"^\S+ [EC] [\w.]+: ")  # "12:00:01 E name: " before a service's error
LAUNCHER = re.compile(r"torch[./]distributed[./]elastic|ChildFailedError")  # torchrun's report of a rank's failure
WARNINGS = re.compile(r"(^|\s)W [\w.]+: ")


class RunStalled(Exception):
    pass


class StallWatch:
    """`check(progress, phase)` each poll: `progress` is anything that changes when the run moves (steps, versions,
    the buffer's counts of generated and consumed groups)."""

    def __init__(self, timeout_s: float, logs: Path, silent=lambda: []):
        """`silent()`: the services that do not answer their health check now (hung: stopped, or stuck)."""
        self.timeout_s, self.logs, self.silent = timeout_s, logs, silent
        self.progress: object = None
        self.since = time.monotonic()

    def check(self, progress: object, phase: str) -> None:
        now = time.monotonic()
        if progress != self.progress:
            self.progress, self.since = progress, now
        elif self.timeout_s and now - self.since > self.timeout_s:
            raise RunStalled(self.describe(phase, now - self.since))

    def describe(self, phase: str, idle_s: float) -> str:
        text = f"no progress for {idle_s:.0f} s (no step, no weight sync, no sample), the trainer in phase {phase!r}"
        silent = self.silent()
        if silent:
            return f"{text}; the {' and the '.join(silent)} service does not answer its health check (hung?)"
        for name in SUSPECTS.get(phase, ("trainer", "rollout", "engine", "reward", "buffer")):
            for path in sorted(self.logs.glob(f"{name}*.log")):
                line = last_error(path)
                if line:
                    return f"{text}; the last error of the {path.stem} service ({path}):\n  {line}"
        return f"{text}; no service logged an error (logs in {self.logs})"


def last_error(path: Path, warnings: bool = True, tail_bytes: int = 1 << 20) -> str | None:
    """The last line of `path` that reports an error, else (with `warnings`) a warning, within its last MiB;
    torchrun's own report of a failed rank is passed over for the rank's error."""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    for pattern in (ERRORS, WARNINGS) if warnings else (ERRORS,):
        found = next(
            (line.strip() for line in reversed(lines) if pattern.search(line) and not LAUNCHER.search(line)), None
        )
        if found:
            return found
    return None
