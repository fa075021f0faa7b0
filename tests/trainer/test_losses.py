"""Losses against values worked out by hand: KL estimators, PPO clip and dual-clip branch by branch, GSPO and CISPO
gradients, TIS clipping, token vs sequence aggregation, value and SFT losses, the chunked log-prob/entropy against
the naive log-softmax, and a few gradient steps raising the log-prob of positive-advantage tokens."""

import math

import pytest
import torch

from services.trainer.losses import (
    aggregate,
    approx_kl,
    cispo_loss,
    policy_loss,
    ppo_clip_loss,
    tis_weights,
    token_logprobs_and_entropy,
    value_loss,
)


def _close(actual: torch.Tensor, expected, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def test_kl_estimators_for_one_pair():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])  # log r = 1
    _close(approx_kl(logp, ref, "k1"), [[1.0]])
    _close(approx_kl(logp, ref, "k2"), [[0.5]])
    _close(approx_kl(logp, ref, "k3"), [[math.exp(-1) + 1 - 1]])  # exp(ref - logp) - (ref - logp) - 1
    _close(approx_kl(logp, ref, "low_var_kl"), [[math.exp(-1)]])
    far, near = torch.tensor([[-20.0]]), torch.tensor([[0.0]])  # k3 = e^20 - 21, far above the clamp
    _close(approx_kl(far, near, "low_var_kl"), [[10.0]])
    assert approx_kl(far, near, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    with pytest.raises(ValueError, match="kl_loss_type 'k4' is unknown"):
        approx_kl(logp, ref, "k4")


def test_ppo_clip_and_dual_clip_branch_by_branch():
    # eps 0.2, dual-clip c = 3; each column exercises one branch of the max / min
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0, 2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    loss_BT, clipped_BT = ppo_clip_loss(ratio.log(), adv, 0.2, 0.2, eps_clip_c=3.0)
    # A>0 r=1.5: clipped at -1.2. A>0 r=0.5: -0.5 (the min ratio is not clipped for A>0).
    # A<0 r=0.5: clipped 0.8. A<0 r=5: unclipped 5 capped by dual-clip at 3. A<0 r=2: 2, under the cap.
    _close(loss_BT, [[-1.2, -0.5, 0.8, 3.0, 2.0]])
    _close(clipped_BT, [[1.0, 0.0, 1.0, 0.0, 0.0]])
    loss_BT.sum().backward()
    _close(ratio.grad, [[0.0, -1.0, 0.0, 0.0, 1.0]])  # clipped and dual-clipped tokens get no gradient
    without_dual, _ = ppo_clip_loss(ratio.detach().log(), adv, 0.2, 0.2)
    _close(without_dual, [[-1.2, -0.5, 0.8, 5.0, 2.0]])


def test_asymmetric_clip_range():
    ratio = torch.tensor([[1.25, 1.25, 0.75]])
    loss_BT, clipped_BT = ppo_clip_loss(ratio.log(), torch.tensor([[1.0, -1.0, -1.0]]), 0.2, 0.28)
    # upper bound 1.28 leaves 1.25 alone; for A<0, max(1.25, 1.25) and max(0.75, 0.8) = 0.8 clipped
    _close(loss_BT, [[-1.25, 1.25, 0.8]])
    _close(clipped_BT, [[0.0, 0.0, 1.0]])


def test_cispo_clips_the_weight_but_keeps_the_gradient():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    log_ratio = torch.tensor([[math.log(2.0), math.log(1.1)]])
    loss_BT, clipped_BT = cispo_loss(log_ratio, logp, torch.tensor([[1.0, 1.0]]), 1.0, 0.2)
    _close(loss_BT, [[1.2, 1.1]])  # -w * A * logp with w = min(2, 1.2) and 1.1
    _close(clipped_BT, [[1.0, 0.0]])
    loss_BT.sum().backward()
    _close(logp.grad, [[-1.2, -1.1]])


def test_gspo_uses_one_ratio_per_sequence():
    logp = torch.tensor([[0.05, 0.15, 7.0]], requires_grad=True)  # third token is masked out
    old, adv, mask = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(logp, mask, old_logprobs_BT=old, advantages_BT=adv, advantage_estimator="gspo")
    s = math.exp(0.1)  # exp(mean(0.05, 0.15)), inside [0.8, 1.2]
    _close(loss, -s)
    loss.backward()
    _close(logp.grad, [[-s / 2, -s / 2, 0.0]])  # d(-s)/dlogp_j = -s / (number of trained tokens)
    _close(metrics["ppo_kl"], -0.1)


def test_tis_weights_are_clipped_and_detached():
    old = torch.tensor([[math.log(3.0), math.log(0.5), math.log(0.05)]], requires_grad=True)
    weights_BT, clipped_BT = tis_weights(old, torch.zeros(1, 3), tis_clip=2.0, tis_clip_low=0.1)
    _close(weights_BT, [[2.0, 0.5, 0.1]])
    _close(clipped_BT, [[1.0, 0.0, 1.0]])
    assert not weights_BT.requires_grad


def test_tis_multiplies_the_policy_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.tensor([[-math.log(3.0), 0.0]])  # weights min(3, 2) = 2 and 1
    loss, metrics = policy_loss(
        logp,
        torch.ones(1, 2),
        old_logprobs_BT=torch.zeros(1, 2),
        advantages_BT=torch.ones(1, 2),
        rollout_logprobs_BT=rollout,
        use_tis=True,
    )
    _close(loss, (-2.0 - 1.0) / 2)  # ratio 1: pg loss -A per token, times the weights, averaged
    _close(metrics["tis_clipfrac"], 0.5)
    _close(metrics["tis"], 1.5)


def test_token_and_sequence_aggregation_differ_on_unequal_lengths():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    _close(aggregate(values, mask, "token"), (4 + 3) / 5)
    _close(aggregate(values, mask, "sequence"), (1 + 3) / 2)


def test_entropy_bonus_and_kl_loss_add_up():
    mask = torch.tensor([[1.0, 1.0]])
    logp = torch.tensor([[-1.0, -1.0]])
    loss, metrics = policy_loss(
        logp,
        mask,
        old_logprobs_BT=logp,
        advantages_BT=torch.tensor([[0.5, 0.5]]),
        entropy_BT=torch.tensor([[2.0, 4.0]]),
        entropy_coef=0.1,
        ref_logprobs_BT=torch.tensor([[-2.0, -1.0]]),
        use_kl_loss=True,
        kl_loss_coef=0.5,
        kl_loss_type="k1",
    )
    # pg -0.5 (ratio 1); entropy mean 3; k1 mean (1 + 0) / 2
    _close(loss, -0.5 - 0.1 * 3 + 0.5 * 0.5)
    _close(metrics["entropy"], 3.0)
    _close(metrics["kl_loss"], 0.5)
    _close(metrics["pg_clipfrac"], 0.0)


def test_sft_loss_and_use_rollout_logprobs():
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = policy_loss(logp, mask, loss_type="sft_loss")
    _close(loss, 2.0)  # -(-1 - 3 - 2) / 3
    _close(metrics["sft_loss"], 2.0)
    loss, _ = policy_loss(
        torch.zeros(1, 1),
        torch.ones(1, 1),
        advantages_BT=torch.ones(1, 1),
        rollout_logprobs_BT=torch.tensor([[math.log(1 / 1.1)]]),
        use_rollout_logprobs=True,
    )
    _close(loss, -1.1)  # ratio exp(0 - log(1/1.1)) = 1.1, inside the clip range


def test_value_loss_takes_the_larger_of_clipped_and_unclipped():
    values = torch.tensor([[1.0, 0.6, 1.0]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 3), value_clip=0.2)
    # clipped values 0.7, 0.6, 0.7: max((1-2)^2, (0.7-2)^2) = 1.69; 0.36; max(1, 0.49) = 1
    _close(loss, 0.5 * (1.69 + 0.36 + 1.0) / 3)
    _close(metrics["value_clipfrac"], 2 / 3)


def test_chunked_logprobs_and_entropy_match_the_naive_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(10, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (10,))
    logp, entropy = token_logprobs_and_entropy(logits, tokens, chunk_size=3)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_all = torch.log_softmax(ref_logits, dim=-1)
    ref_logp = ref_all[torch.arange(10), tokens]
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    _close(logp, ref_logp)
    _close(entropy, ref_entropy)
    weights = torch.randn(10)
    (logp * weights + entropy * weights.flip(0)).sum().backward()
    (ref_logp * weights + ref_entropy * weights.flip(0)).sum().backward()
    _close(logits.grad, ref_logits.grad)


def test_chunked_logprobs_of_bf16_logits_are_float32_and_close_to_a_float32_reference():
    torch.manual_seed(1)
    ref_logits = torch.randn(9, 50) * 3
    logits = ref_logits.to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 50, (9,))
    logp, entropy = token_logprobs_and_entropy(logits, tokens, chunk_size=4)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logits.requires_grad_(True)
    ref_logp = torch.log_softmax(ref_logits, dim=-1)[torch.arange(9), tokens]
    _close(logp, ref_logp, tol=5e-2)  # bf16 rounds the logits to ~3 significant digits
    logp.sum().backward()
    ref_logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    _close(logits.grad.float(), ref_logits.grad, tol=2e-2)


def test_a_few_policy_steps_raise_positive_and_lower_negative_advantage_tokens():
    torch.manual_seed(0)
    logits = torch.zeros(4, 5, requires_grad=True)  # one row per token: the tiniest "policy"
    tokens = torch.tensor([0, 1, 2, 3])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    with torch.no_grad():
        start, _ = token_logprobs_and_entropy(logits, tokens)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    for _ in range(3):
        logp, entropy = token_logprobs_and_entropy(logits, tokens, chunk_size=2)
        loss, _ = policy_loss(
            logp[None], mask, old_logprobs_BT=start[None], advantages_BT=advantages, entropy_BT=entropy[None]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        end, _ = token_logprobs_and_entropy(logits, tokens)
    assert (end[:2] > start[:2]).all() and (end[2:] < start[2:]).all()


def test_bad_policy_arguments_name_the_argument():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    kwargs = {"old_logprobs_BT": logp, "advantages_BT": logp}
    with pytest.raises(ValueError, match=r"advantages_BT has shape \(2, 2\), loss_mask_BT \(2, 3\)"):
        policy_loss(logp, mask, old_logprobs_BT=logp, advantages_BT=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="advantages_BT is required with policy_loss"):
        policy_loss(logp, mask, old_logprobs_BT=logp)
    with pytest.raises(ValueError, match="ref_logprobs_BT is required with use_kl_loss"):
        policy_loss(logp, mask, use_kl_loss=True, **kwargs)
    with pytest.raises(ValueError, match="eps_clip_c must be greater than 1"):
        policy_loss(logp, mask, eps_clip_c=0.5, **kwargs)
    with pytest.raises(ValueError, match="loss_aggregation 'mean' is unknown"):
        policy_loss(logp, mask, loss_aggregation="mean", **kwargs)
    with pytest.raises(ValueError, match="advantage_estimator 'ppo2' is unknown"):
        policy_loss(logp, mask, advantage_estimator="ppo2", **kwargs)
    with pytest.raises(ValueError, match="use_tis and use_rollout_logprobs cannot both be set"):
        policy_loss(logp, mask, rollout_logprobs_BT=logp, use_tis=True, use_rollout_logprobs=True, **kwargs)
    with pytest.raises(ValueError, match="tokens_T"):
        token_logprobs_and_entropy(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))


def test_policy_loss_takes_the_configs_loss_settings_whole():
    """The actor passes its config's `loss` as it is; a keyword overrides one setting."""
    from services.trainer.config import TrainerConfig

    settings = TrainerConfig(eps_clip=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1").loss
    logp, mask = torch.tensor([[math.log(2.0)]]), torch.ones(1, 1)
    kwargs = {"old_logprobs_BT": torch.zeros(1, 1), "advantages_BT": torch.ones(1, 1), "ref_logprobs_BT": logp - 1}
    loss, metrics = policy_loss(logp, mask, settings, **kwargs)
    _close(loss, -1.1 + 0.5 * 1.0)  # ratio 2 clipped to 1.1; k1 = 1
    _close(metrics["kl_loss"], 1.0)
    loss, _ = policy_loss(logp, mask, settings, eps_clip=0.5, use_kl_loss=False, **kwargs)
    _close(loss, -1.5)
    with pytest.raises(TypeError, match="eps_clipp"):
        policy_loss(logp, mask, settings, eps_clipp=0.5, **kwargs)


def _ragged(seed: int, lengths=(5, 3, 7, 1)):
    """Random per-sample tensors as slime keeps them (one 1-D tensor per sample) and the same right-padded [B, T]."""
    g = torch.Generator().manual_seed(seed)
    per = {k: [torch.randn(n, generator=g) * 0.3 for n in lengths] for k in ("new", "old", "ref")}
    per["new"] = [(t - 1.0).requires_grad_() for t in per["new"]]
    per["old"] = [t.detach() + 0.1 * torch.randn(t.shape, generator=g) for t in per["new"]]
    per["adv"] = [torch.full((n,), float(torch.randn(1, generator=g))) for n in lengths]
    per["mask"] = [torch.ones(n) for n in lengths]
    per["mask"][0][1] = 0.0  # a token that is not trained

    def pad(ts):
        out = torch.zeros(len(ts), max(lengths))
        for i, t in enumerate(ts):
            out[i, : len(t)] = t
        return out

    return per, {k: pad([t.detach() for t in per[k]]) for k in ("new", "old", "ref", "adv", "mask")}


def _slime_sample_mean(values: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """slime's sum_of_sample_mean (per-sample mean over its loss mask), averaged over the samples."""
    return torch.stack([(v * m).sum() / m.sum().clamp(min=1) for v, m in zip(values, masks, strict=True)]).mean()


def test_opsm_equals_slimes_mask_on_random_samples():
    """slime's compute_opsm_mask (ppo_utils.py at 624b824) and its use in policy_loss_function: per sample,
    seq_kl = mean over the loss mask of old - new; tokens with advantage < 0 of a sample with seq_kl > delta get
    no policy loss."""
    seen = set()
    for seed in range(8):
        per, pad = _ragged(seed)
        delta = 0.02
        ref_terms = []
        for new, old, adv, mask in zip(per["new"], per["old"], per["adv"], per["mask"], strict=True):
            seq_kl = ((old - new) * mask).sum() / torch.clamp_min(mask.sum(), 1)
            opsm = 1 - ((adv < 0) & (seq_kl > delta)).float()
            ratio = (new - old).exp()
            pg = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv)
            ref_terms.append(pg * opsm)
        expected = _slime_sample_mean(ref_terms, per["mask"])
        expected_grads = torch.autograd.grad(expected, per["new"])
        new = pad["new"].detach().requires_grad_()
        loss, metrics = policy_loss(new, pad["mask"], old_logprobs_BT=pad["old"], advantages_BT=pad["adv"],
                                    loss_aggregation="sequence", use_opsm=True, opsm_delta=delta)  # fmt: skip
        _close(loss, expected.detach())
        (grad,) = torch.autograd.grad(loss, new)
        for i, g in enumerate(expected_grads):
            _close(grad[i, : len(g)], g)
        masked = [bool(((o - n) * m).sum() / m.sum() > delta) and bool(a[0] < 0)
                  for n, o, a, m in zip(per["new"], per["old"], per["adv"], per["mask"], strict=True)]  # fmt: skip
        assert (metrics["opsm_clipfrac"] > 0) == any(masked)
        unmasked, _ = policy_loss(new, pad["mask"], old_logprobs_BT=pad["old"], advantages_BT=pad["adv"],
                                  loss_aggregation="sequence")  # fmt: skip
        assert any(masked) == (not torch.isclose(unmasked, loss)), seed
        seen.add(any(masked))
    assert seen == {True, False}  # the seeds mask some samples and leave others


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_unbiased_kl_equals_slimes_on_random_samples(kl_type):
    """slime's compute_approx_kl with importance_ratio = exp(log_probs - old_log_probs) (--use-unbiased-kl): the
    estimate times the ratio, clamped after for low_var_kl; the ratio carries gradient."""
    per, pad = _ragged(7)
    ref_terms = []
    for new, old, ref in zip(per["new"], per["old"], per["ref"], strict=True):
        log_ratio = new - ref
        kl = {"k1": log_ratio, "k2": log_ratio**2 / 2}.get(kl_type)
        if kl is None:
            kl = (-log_ratio).exp() - 1 + log_ratio
        kl = torch.exp(new - old) * kl
        ref_terms.append(kl.clamp(-10, 10) if kl_type == "low_var_kl" else kl)
    expected = _slime_sample_mean(ref_terms, per["mask"])
    expected_grads = torch.autograd.grad(expected, per["new"])
    new = pad["new"].detach().requires_grad_()
    settings = dict(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=kl_type, use_unbiased_kl=True)
    _, metrics = policy_loss(new, pad["mask"], old_logprobs_BT=pad["old"], advantages_BT=pad["adv"],
                             ref_logprobs_BT=pad["ref"], loss_aggregation="sequence", **settings)  # fmt: skip
    _close(metrics["kl_loss"], expected.detach())
    kl = aggregate(approx_kl(new, pad["ref"], kl_type, torch.exp(new - pad["old"])), pad["mask"], "sequence")
    (grad,) = torch.autograd.grad(kl, new)
    for i, g in enumerate(expected_grads):
        _close(grad[i, : len(g)], g)
    _, biased = policy_loss(new, pad["mask"], old_logprobs_BT=pad["old"], advantages_BT=pad["adv"],
                            ref_logprobs_BT=pad["ref"], loss_aggregation="sequence",
                            **{**settings, "use_unbiased_kl": False})  # fmt: skip
    assert not torch.isclose(biased["kl_loss"], metrics["kl_loss"])  # the ratios are not all 1


def test_unbiased_kl_needs_the_old_log_probs_and_names_them():
    with pytest.raises(ValueError, match="old_logprobs_BT is required with use_unbiased_kl"):
        policy_loss(torch.zeros(1, 2), torch.ones(1, 2), loss_type="sft_loss", ref_logprobs_BT=torch.zeros(1, 2),
                    use_kl_loss=True, use_unbiased_kl=True)  # fmt: skip
