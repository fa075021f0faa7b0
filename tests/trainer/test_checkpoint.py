"""Checkpoints: stop-and-resume gives the same parameters as an uninterrupted run (model, AdamW moments, lr
schedule, RNG), a crash mid-save keeps the previous checkpoint, and a missing one says what to check."""

import pytest
import torch

from services.trainer import checkpoint
from services.trainer.optimizer import build_optimizer, build_scheduler


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    scheduler = build_scheduler(optimizer, warmup=2, decay_steps=10, style="cosine", lr=1e-2, min_lr=1e-3)
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    x = torch.randn(16, 4)  # drawn from the RNG, so a resume must restore it too
    loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean() + torch.nn.functional.dropout(x, 0.5).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path):
    straight = _setup()
    for _ in range(6):
        _step(*straight)
    first = _setup()
    for _ in range(3):
        _step(*first)
    model, optimizer, scheduler = first
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "policy_version": 3}  # fmt: skip
    checkpoint.save(tmp_path, 3, state)
    torch.manual_seed(123)  # the resumed process starts with other RNG states
    model, optimizer, scheduler = resumed = _setup()
    loaded = checkpoint.load(tmp_path)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    assert loaded["step"] == 3 and loaded["policy_version"] == 3
    for _ in range(3):
        _step(*resumed)
    for a, b in zip(straight[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    checkpoint.save(tmp_path, 1, {"x": 1})
    (tmp_path / ".iter_0000002.partial").mkdir()  # what a crash between the shard writes and the rename leaves
    assert checkpoint.latest_step(tmp_path) == 1 and checkpoint.load(tmp_path)["x"] == 1
    checkpoint.save(tmp_path, 2, {"x": 2})
    assert checkpoint.latest_step(tmp_path) == 2 and not (tmp_path / ".iter_0000002.partial").exists()


def test_missing_checkpoints_say_what_to_check(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        checkpoint.load(tmp_path)
    checkpoint.save(tmp_path, 5, {"x": 1})
    with pytest.raises(FileNotFoundError, match="saved with another TP/PP/EP size"):
        checkpoint.load(tmp_path, checkpoint.shard_name(1, 0))
