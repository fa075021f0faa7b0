"""What `slipstream train` says when a child fails or the run stalls: the error line of the part at fault, found in
its log (torchrun's own report of a failed rank passed over)."""

from pathlib import Path

from services.train.stall import StallWatch, last_error

TORCHRUN_LOG = """\
11:02:01 I services.trainer.loop: trainer: 2 ranks (TP 1, PP 1, DP 2)
11:02:02 W services.trainer.loop: no --save: a resume starts from --hf-checkpoint
[rank1]: Traceback (most recent call last):
[rank1]:   File "/app/services/trainer/loop.py", line 118, in __init__
[rank1]:     config.batch_sizes(self.dp_size).check()
[rank1]: services.trainer.batching.BatchSizeError: each rank's part of a step (16 samples) is not divisible by 32
E1123 11:02:03.456000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
  File "/usr/lib/python3.11/runpy.py", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
services.trainer FAILED
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_ranks_own_error_is_found_past_torchruns_report(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(TORCHRUN_LOG)
    assert last_error(log) == (
        "[rank1]: services.trainer.batching.BatchSizeError: each rank's part of a step (16 samples) is not divisible "
        "by 32"
    )


def test_a_warning_is_reported_when_no_error_was_logged(tmp_path):
    log = tmp_path / "rollout.log"
    log.write_text("11:00:00 I services.rollout.workers: leasing\n"
                   "11:00:05 W services.rollout.engines: engine http://e:1 failed (1 of 2 before eviction): timeout\n"
                   "11:00:06 I services.rollout.workers: still leasing\n")  # fmt: skip
    assert last_error(log).endswith("failed (1 of 2 before eviction): timeout")
    (tmp_path / "quiet.log").write_text("11:00:00 I services.buffer.core: ready\n")
    assert last_error(tmp_path / "quiet.log") is None


def test_a_stall_names_the_phase_and_looks_first_where_that_phase_waits(tmp_path):
    logs: Path = tmp_path
    (logs / "trainer.log").write_text("11:00:00 E services.trainer.loop: trainer-side trouble\n")
    (logs / "rollout.log").write_text("11:00:00 E services.rollout.weight_sync: gateway-side trouble\n")
    watch = StallWatch(timeout_s=60, logs=logs)
    assert "phase 'waiting_batch'; the last error of the rollout service" in watch.describe("waiting_batch", 61)
    assert "phase 'sync'; the last error of the trainer service" in watch.describe("sync", 61)
    watch.check(("step", 1), "train")
    watch.since -= 61  # an hour of silence need not be waited for: the watch reads the clock
    try:
        watch.check(("step", 1), "train")
    except Exception as e:
        assert "no progress for 61 s" in str(e) and "trainer-side trouble" in str(e)
    else:
        raise AssertionError("no stall reported")
