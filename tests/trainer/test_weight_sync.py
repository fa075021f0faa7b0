"""The trainer's weight-sync watchdog, its attempts' phases and the weight group's NCCL settings (the sync itself, with
real engines, is tested in tests/rollout/test_weight_sync.py)."""

import subprocess
import sys
import threading
import time

import pytest

from services.trainer.weight_sync import STALLED_EXIT_CODE, SendAttempt, Watchdog
from services.weightsync.group import NCCL_SETTINGS, apply_nccl_settings
from services.weightsync.protocol import SENDER_MOVES as MOVES
from services.weightsync.protocol import SenderPhase as Phase


def test_every_member_gets_sglangs_nccl_settings_unless_its_environment_says_otherwise(caplog):
    assert apply_nccl_settings({}) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"} == NCCL_SETTINGS
    assert apply_nccl_settings({"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"] == "1"  # as SGLang: the user's wins
    assert "NCCL_CUMEM_ENABLE=1 is set" in caplog.text  # and every member must share it: said


def test_an_attempt_moves_only_as_its_table_allows_and_ends_once():
    attempt = SendAttempt(3, peers_waiting=True)
    attempt.in_flight = True
    attempt.move(Phase.SENDING)
    with pytest.raises(RuntimeError, match="version 3: no move from sending to committing"):
        attempt.move(Phase.COMMITTING)  # not before the engines loaded every bucket
    attempt.move(Phase.SENT)
    assert not attempt.in_flight and not attempt.peers_waiting  # nothing of the transfer is left
    attempt.end(None)  # a sender other than the coordinator: its senders' shared outcome commits it
    assert attempt.phase is Phase.COMMITTED and attempt.stream is None
    attempt.end(None)  # ended once: the second call changes nothing
    failed = SendAttempt(4, peers_waiting=False)
    failed.end(RuntimeError("the gateway left"))  # a failure in any phase ends it failed
    assert failed.phase is Phase.FAILED
    assert all(not MOVES[end] for end in (Phase.COMMITTED, Phase.FAILED))  # no way out of an end
    assert all(Phase.FAILED in MOVES[phase] for phase in MOVES if phase not in (Phase.COMMITTED, Phase.FAILED))


def test_the_watchdog_calls_its_remedy_once_a_sync_makes_no_progress():
    remedied = threading.Event()
    with Watchdog(0.5, remedied.set) as watchdog:
        for _ in range(10):  # progress keeps it quiet
            time.sleep(0.1)
            watchdog.progress("sending")
        assert not remedied.is_set()
        assert remedied.wait(30)  # then silence past the timeout
    assert watchdog.stalled.startswith("the weight sync made no progress for") and "(sending)" in watchdog.stalled


STUCK = """
import logging, time
from services.trainer.weight_sync import Watchdog
logging.basicConfig(level="INFO")
with Watchdog(0.5, lambda: None, grace_s=0.5) as watchdog:
    watchdog.progress("broadcasting bucket 3")
    time.sleep(120)  # stuck where the remedy cannot reach
"""


def test_a_sync_the_remedy_cannot_end_stops_the_process_saying_where():
    result = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=100)
    assert result.returncode == STALLED_EXIT_CODE
    assert "(broadcasting bucket 3), and did not end once the group was aborted; the trainer stops" in result.stderr
