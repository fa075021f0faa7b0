"""The trainer as a real process against a real buffer: it trains the buffer's steps, commits them, moves the
policy version, saves on the interval, answers its control surface, and a stop-and-resume run ends with exactly the
parameters of an uninterrupted one."""

import re
import time
from pathlib import Path

import grpc
import pytest
import torch

from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from tests.trainer.conftest import NUM_STEPS, trainer_args, weights


def test_trainer_trains_commits_and_saves(filled_buffer, service_process, channel_to, model, tmp_path):
    buffer = filled_buffer("run")
    extra = ["--num-rollout", str(NUM_STEPS), "--save-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
             "--save-hf", str(tmp_path / "hf")]  # fmt: skip
    proc = service_process(*trainer_args(model, buffer, tmp_path / "ckpt", *extra))
    assert proc.wait(timeout_s=240) == 0, proc.log
    assert [f"step {i}:" in proc.log for i in range(1, NUM_STEPS + 1)] == [True] * NUM_STEPS
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    state = buffer_pb2_grpc.BufferServiceStub(channel_to(buffer)).GetState(buffer_pb2.GetStateRequest(), timeout=10)
    assert state.last_committed_step == NUM_STEPS - 1 and state.policy_version == NUM_STEPS
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # the trained weights, as HF loads them
    original = AutoModelForCausalLM.from_pretrained(model)
    assert not torch.equal(exported.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)


def test_save_hf_alone_writes_the_trained_model_at_the_end(filled_buffer, service_process, model, tmp_path):
    """--save-hf without --save: no checkpoint, and the model of the last step as an HF folder transformers loads."""
    proc = service_process(*trainer_args(model, filled_buffer("hf"), None, "--num-rollout", "2",
                                         "--save-hf", str(tmp_path / "hf")))  # fmt: skip
    assert proc.wait(timeout_s=240) == 0, proc.log
    assert "the model of step 2 written to" in proc.log
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    original = AutoModelForCausalLM.from_pretrained(model)
    assert not torch.equal(exported.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])  # ppo: the critic is saved and resumed too
def test_stop_and_resume_equals_an_uninterrupted_run(filled_buffer, service_process, model, tmp_path, estimator):
    algorithm = ["--advantage-estimator", estimator]
    straight = service_process(
        *trainer_args(model, filled_buffer("a"), tmp_path / "a", "--num-rollout", "4", *algorithm)
    )
    assert straight.wait(timeout_s=240) == 0, straight.log
    second = filled_buffer("b")
    first_half = service_process(*trainer_args(model, second, tmp_path / "b", "--num-rollout", "2", *algorithm))
    assert first_half.wait(timeout_s=240) == 0, first_half.log
    resumed = service_process(*trainer_args(model, second, tmp_path / "b", "--num-rollout", "4", *algorithm,
                                            "--load", str(tmp_path / "b")))  # fmt: skip
    assert resumed.wait(timeout_s=240) == 0, resumed.log
    assert "resumed from" in resumed.log and "at step 2" in resumed.log
    for part in ["model", "critic_model"] if estimator == "ppo" else ["model"]:
        a, b = weights(tmp_path / "a", 4, part), weights(tmp_path / "b", 4, part)
        tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
        assert tensors and all(torch.equal(a[k], b[k]) for k in tensors), part
    a, half = weights(tmp_path / "a", 4), weights(tmp_path / "b", 2)
    assert not all(torch.equal(v, half[k]) for k, v in a.items() if isinstance(v, torch.Tensor))  # it did train


def test_control_surface_reports_saves_and_stops(filled_buffer, service_process, model, tmp_path):
    proc = service_process(*trainer_args(model, filled_buffer("c"), tmp_path / "c"))  # no --num-rollout: it waits
    deadline = time.monotonic() + 120
    while not (match := re.search(r"trainer serving on [^:]+:(\d+)", proc.log)):
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log
        time.sleep(0.2)
    (tmp_path / "c").mkdir(exist_ok=True)
    (tmp_path / "c" / "a-file").write_text("in the way")
    (tmp_path / "c" / "out").symlink_to(tmp_path)
    with grpc.insecure_channel(f"127.0.0.1:{match[1]}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        for path in ("/tmp/elsewhere", "../elsewhere", "x" * 300, "out/elsewhere"):  # only folders under --save
            with pytest.raises(grpc.RpcError) as refused:
                stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=path), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "path:" in refused.value.details()
        with pytest.raises(grpc.RpcError) as failed:  # cannot be written: that call's error, the trainer goes on
            stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path="a-file/snapshot"), timeout=120)
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.value.details()
        assert "Not a directory" in failed.value.details()
        named = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path="snapshots/one"), timeout=120)
        assert Path(named.path).parent == (tmp_path / "c" / "snapshots" / "one").resolve()
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        assert saved.path.endswith(f"iter_{saved.step:07d}")
        status = stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        assert status.world_size == 1 and status.step >= saved.step and "loss" in status.last_metrics
        assert status.phase in ("waiting_batch", "train")
        stub.Stop(trainer_pb2.StopRequest(save=True), timeout=10)
    assert proc.wait(timeout_s=120) == 0, proc.log
