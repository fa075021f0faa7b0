"""The optimizer's pieces against hand-computed values: the lr schedule, weight-decay groups, gradient clipping."""

import math

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.optimizer import build_optimizer, build_scheduler, clip_gradients, lr_factor


def test_warmup_then_cosine_to_min_lr():
    assert [lr_factor(s, 4, None, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, 4, 14, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(9, 4, 14, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(14, 4, 14, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(100, 4, 14, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 4, 14, "linear", 0.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lr_decay_style must be constant, linear or cosine, got 'wsd'"):
        lr_factor(9, 0, 14, "wsd", 0.0)


def test_a_decaying_lr_decays_over_the_run_unless_told_otherwise():
    """As megatron's --lr-decay-iters defaults to the run's steps: `--lr-decay-style cosine` alone decays over
    --num-rollout x --num-steps-per-rollout (it once stayed constant), and without a run length it is refused."""
    batch = {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "global_batch_size": 4, "num_steps_per_rollout": 2}
    config = TrainerConfig(**batch, num_rollout=50, lr_decay_style="cosine")
    assert config.lr_decay_steps(config.optimizer) == 100
    config = TrainerConfig(**batch, num_rollout=50, lr_decay_style="cosine", lr_decay_iters=30)
    assert config.lr_decay_steps(config.optimizer) == 30
    with pytest.raises(ValueError, match="--lr-decay-style cosine decays over --lr-decay-iters steps"):
        TrainerConfig(**batch, lr_decay_style="cosine")
    assert TrainerConfig(**batch).lr_decay_steps(TrainerConfig(**batch).optimizer) is None  # constant: no horizon


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]  # the bias takes no decay
    scheduler = build_scheduler(optimizer, warmup=2, decay_steps=None, style="constant", lr=1e-3, min_lr=0.0)
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3])


def test_clipping_scales_to_the_norm():
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    assert clip_gradients(model, max_norm=1.0) == pytest.approx(5.0)
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    model.weight.grad = torch.tensor([[0.3, 0.4]])
    assert clip_gradients(model, max_norm=1.0) == pytest.approx(0.5)
    assert model.weight.grad[0].tolist() == pytest.approx([0.3, 0.4])


def test_bf16_parameters_keep_float32_masters_so_small_updates_add_up():
    model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    start = model.weight.detach().float().clone()
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(50):
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
    moved = (optimizer.masters[0] - start).abs().mean().item()
    assert moved == pytest.approx(50 * 1e-5, rel=0.05)  # each step moves by ~lr, far below bf16's resolution near 1
    assert torch.equal(model.weight, optimizer.masters[0].to(torch.bfloat16))
    saved = optimizer.state_dict()
    other = build_optimizer(torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16), 1e-5, 0.0, (0.9, 0.999), 1e-8)
    other.load_state_dict(saved)
    assert torch.equal(other.masters[0], optimizer.masters[0])


def test_masters_take_weights_loaded_into_the_model_after_the_optimizer_was_built():
    """--bf16 with --load of an HF folder: the weights arrive after the masters were copied from --hf-checkpoint's;
    without the reload, the first step would put the start weights back."""
    model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    with torch.no_grad():
        model.weight.fill_(0.5)
    optimizer.reload_model_params()
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer.step()
    assert torch.equal(model.weight, torch.full_like(model.weight, 0.5))


def test_bf16_weights_from_a_float32_checkpoint_move_as_the_float32_weights_cast_to_bf16():
    """The masters start from the checkpoint's float32 values (`checkpoint_value`, kept by the loader), not from their
    bf16 rounding: masters on the bf16 grid would leave every bf16 weight where it was until its updates add up to
    half a grid step, so that a real model at lr 3e-6 did not learn in 60 steps (its entropy stayed flat) where the
    same model in float32 did."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 64, bias=False)
    model = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(reference.weight)
    model.weight.checkpoint_value = reference.weight.detach().clone()
    optimizer = build_optimizer(model, lr=3e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    plain = torch.optim.AdamW(reference.parameters(), lr=3e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    start = model.weight.detach().clone()
    for _ in range(10):
        gradient = torch.randn(64, 64)
        model.weight.grad, reference.weight.grad = gradient.to(torch.bfloat16), gradient.to(torch.bfloat16).float()
        optimizer.step()
        plain.step()
    assert not hasattr(model.weight, "checkpoint_value")  # taken by the optimizer, not kept beside it
    assert torch.equal(model.weight, reference.weight.detach().to(torch.bfloat16))
    assert (model.weight != start).float().mean() > 0.01  # some weights cross a grid point already


def test_bf16_in_megatrons_ddp_adds_gradients_up_in_float32_and_steps_the_masters_on_them(tmp_path):
    """The trainer's bf16 path on one rank: megatron's DDP holds float32 gradients (a bf16 parameter cannot hold them
    as `.grad`), the clipping's norm and MasterAdamW's step read them."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer import data_parallel
    from services.trainer.actor import Actor, Groups
    from services.trainer.data import RolloutBatch
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    try:
        model, gpt = load_gpt_model(write_tiny_model(tmp_path / "model"), dtype=torch.bfloat16)
        config = TrainerConfig(rollout_batch_size=1, n_samples_per_prompt=2, global_batch_size=2, micro_batch_size=1,
                               lr=1e-3, clip_grad=1e-3, bf16=True)  # fmt: skip
        ddp, optimizer, scheduler = data_parallel.build(model, config, config.optimizer)
        actor = Actor(config, model, optimizer, scheduler, Groups(vocab_size=gpt.shape.vocab_size), ddp=ddp)
        tokens = torch.randint(0, gpt.shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        old, adv = -torch.rand(2, 16), torch.tensor([[1.0] * 16, [-1.0] * 16])
        batch = RolloutBatch(tokens=list(tokens.numpy()), prompt_lengths=[8, 8], rewards_B=torch.zeros(2),
                             loss_masks=[torch.ones(16).numpy()] * 2, rollout_logprobs=list(old.numpy()),
                             group_size=2, sample_ids=["0", "1"])  # fmt: skip
        before = [p.detach().clone() for p in model.parameters()]
        metrics = actor._step(batch, [0, 1], {"old": old, "ref": None, "adv": adv, "mask": torch.ones(2, 16),
                                              "rollout": old})  # fmt: skip
        grads = [p.main_grad for p in model.parameters()]
        assert all(g.dtype == torch.float32 for g in grads)
        norm = torch.stack([g.norm() for g in grads]).norm().item()  # one rank: every parameter counts
        assert metrics["grad_norm"] > 0.01 and norm == pytest.approx(1e-3, rel=1e-3)  # clipped to 1e-3 in place
        pairs = zip(optimizer.model_params, optimizer.masters, strict=True)
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in pairs)
        assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)) > len(before) // 2
    finally:
        destroy_parallel()
