"""The GPUs this process may give the processes it starts, and how it stops them (services/common/launch.py)."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.parametrize(("visible", "ids"), [(None, ["0", "1", "2", "3"]), ("2,3", ["2", "3"]), ("3,-1,1", ["3"]),
                                              ("", []), ("-1", [])])  # fmt: skip
def test_the_gpus_given_are_those_cuda_visible_devices_names(monkeypatch, tmp_path, visible, ids):
    """The engines take the first of these and the trainer the next ones: a run given GPUs 2 and 3 stays on them."""
    from services.common import launch

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(4)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launch.gpu_ids() == ids
    assert launch.num_gpus() == len(ids)


def test_a_stopped_child_gets_its_sigterm_and_is_not_waited_out(tmp_path):
    """A child frozen by SIGSTOP (as a test freezes an engine) is sent SIGCONT after SIGTERM, as systemd does: it ends
    by the SIGTERM rather than by the SIGKILL at the end of the grace period."""
    from services.common import launch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.send_signal(signal.SIGSTOP)
    child = launch.Child("frozen", "", proc, tmp_path / "frozen.log")
    asyncio.run(launch.stop([child], grace_s=300))
    assert proc.returncode == -signal.SIGTERM
