"""Advantage estimators against values worked out by hand: GRPO's group normalisation (unbiased std, as slime's
torch.std), Dr.GRPO, GAE on a three-token response, REINFORCE++ returns with the KL penalty, whitening."""

import math
import statistics

import pytest
import torch

from services.trainer.advantages import compute_advantages, discounted_returns, gae, whiten


def _close(actual: torch.Tensor, expected: list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def test_grpo_divides_by_the_unbiased_group_std():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    adv_BT, _ = compute_advantages("grpo", rewards_B, mask_BT, group_size=4)
    # mean 0.5, deviations ±0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3): advantage ±0.5 * sqrt(3) = ±0.866
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    _close(adv_BT, [[a, a, 0], [-a, 0, 0], [-a, -a, -a], [0, a, a]])


def test_grpo_normalises_each_group_on_its_own():
    rewards_B = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv_BT, _ = compute_advantages("gspo", rewards_B, torch.ones(4, 1), group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group [1, 0]: unbiased std sqrt(0.5); group [3, 3] has none
    _close(adv_BT, [[a], [-a], [0.0], [0.0]])


def test_dr_grpo_only_subtracts_the_group_mean():
    rewards_B = torch.tensor([2.0, 0.0, 1.0, 1.0])
    adv_BT, _ = compute_advantages("cispo", rewards_B, torch.ones(4, 2), group_size=4, disable_std_normalization=True)
    _close(adv_BT, [[1, 1], [-1, -1], [0, 0], [0, 0]])


def test_gae_on_three_tokens_by_hand():
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0]])
    values_BT = torch.tensor([[0.5, 0.4, 0.3]])
    adv_BT, returns_BT = gae(rewards_BT, values_BT, torch.ones(1, 3), gamma=0.9, lambd=0.8)
    # deltas: 0.9*0.4-0.5 = -0.14, 0.9*0.3-0.4 = -0.13, 1-0.3 = 0.7; A_t = delta_t + 0.72 * A_{t+1}
    _close(adv_BT, [[-0.14 + 0.72 * 0.374, -0.13 + 0.72 * 0.7, 0.7]])
    _close(returns_BT, [[0.12928 + 0.5, 0.374 + 0.4, 1.0]])


def test_ppo_puts_the_reward_on_the_last_token_and_ignores_padded_values():
    rewards_B = torch.tensor([1.0, 2.0])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    values_BT = torch.tensor([[0.5, 0.4, 0.3], [1.0, 0.5, 99.0]])  # 99 is padding: must not be bootstrapped from
    kl_BT = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.4, 5.0]])
    adv_BT, returns_BT = compute_advantages(
        "ppo", rewards_B, mask_BT, group_size=1, values_BT=values_BT, kl_BT=kl_BT, kl_coef=0.5, gamma=0.9, lambd=0.8
    )
    # row 1: token rewards [-0.1, -0.2 + 2] = [-0.1, 1.8]; deltas 0.9*0.5-1-0.1 = -0.65, 1.8-0.5 = 1.3
    _close(adv_BT, [[0.12928, 0.374, 0.7], [-0.65 + 0.72 * 1.3, 1.3, 0.0]])
    _close(returns_BT, [[0.62928, 0.774, 1.0], [-0.65 + 0.72 * 1.3 + 1.0, 1.8, 0.0]])


def test_reinforce_plus_plus_discounts_kl_penalised_token_rewards_then_whitens():
    rewards_B = torch.tensor([1.0, 0.0])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl_BT = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    adv_BT, returns_BT = compute_advantages(
        "reinforce_plus_plus", rewards_B, mask_BT, group_size=1, kl_BT=kl_BT, kl_coef=0.1, gamma=0.5
    )
    # token rewards [-0.01, -0.02, 0.97] and [-0.05, -0.05]; G_t = r_t + 0.5 * G_{t+1}
    expected = [[-0.01 + 0.5 * 0.465, -0.02 + 0.5 * 0.97, 0.97], [-0.05 + 0.5 * -0.05, -0.05, 0.0]]
    _close(returns_BT, expected)
    flat = [0.2225, 0.465, 0.97, -0.075, -0.05]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    _close(adv_BT, [[(x - mean) / std for x in flat[:3]], [(x - mean) / std for x in flat[3:]] + [0.0]], tol=1e-4)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_and_kl_per_token():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 0.0])
    kl_BT = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 4.0]])
    adv_BT, returns_BT = compute_advantages(
        "reinforce_plus_plus_baseline", rewards_B, torch.ones(4, 2), group_size=2, kl_BT=kl_BT, kl_coef=0.25
    )
    # group means 0.5 and 0: [0.5, -0.5, 0, 0], then minus 0.25 * kl per token, no discounting
    flat = [0.25, 0.0, -0.5, -0.5, 0.0, 0.0, 0.0, -1.0]
    _close(returns_BT.flatten(), flat)
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    _close(adv_BT.flatten(), [(x - mean) / std for x in flat], tol=1e-4)


def test_whiten_uses_trained_tokens_only_and_the_unbiased_variance():
    values_BT = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, -7.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    s = math.sqrt(5 / 3)  # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, over n - 1 = 3
    _close(whiten(values_BT, mask_BT), [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 1.5 / s, 0.0]])


def test_normalize_advantages_whitens_grpo():
    rewards_B = torch.tensor([3.0, 1.0])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv_BT, _ = compute_advantages(
        "grpo", rewards_B, mask_BT, group_size=2, disable_std_normalization=True, normalize_advantages=True
    )
    flat = [1.0, 1.0, 1.0, -1.0]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    _close(adv_BT[mask_BT.bool()], [(x - mean) / std for x in flat])


def test_discounted_returns_carry_across_chunks():
    rewards_BT = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    returns_BT = discounted_returns(rewards_BT, 0.5, chunk_size=3)
    _close(returns_BT, [[1 + 2 / 8, 2 / 4, 2 / 2, 2.0, 0.0, 0.0, 0.0]])
    assert discounted_returns(torch.ones(1, 300), 1.0)[0, 0].item() == 300.0  # gamma 1: a plain reverse cumsum


def test_bad_inputs_name_the_argument():
    mask_BT = torch.ones(4, 2)
    with pytest.raises(ValueError, match="rewards contain NaN at sample 3"):
        compute_advantages("grpo", torch.tensor([0.0, 1.0, 0.0, float("nan")]), mask_BT, group_size=2)
    with pytest.raises(ValueError, match="advantage_estimator 'gpro' is unknown"):
        compute_advantages("gpro", torch.zeros(4), mask_BT, group_size=2)
    with pytest.raises(ValueError, match="group_size 3 does not divide the 4 samples"):
        compute_advantages("grpo", torch.zeros(4), mask_BT, group_size=3)
    with pytest.raises(ValueError, match=r"loss_mask_BT has shape \(3, 2\)"):
        compute_advantages("grpo", torch.zeros(4), torch.ones(3, 2), group_size=2)
    with pytest.raises(ValueError, match="'ppo' needs values_BT"):
        compute_advantages("ppo", torch.zeros(4), mask_BT, group_size=1)
    with pytest.raises(ValueError, match=r"kl_BT has shape \(4, 3\)"):
        compute_advantages("ppo", torch.zeros(4), mask_BT, group_size=1, values_BT=mask_BT, kl_BT=torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"kl_coef=0\.1 needs kl_BT"):
        compute_advantages("reinforce_plus_plus", torch.zeros(4), mask_BT, group_size=1, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_coef=0\.1 has no effect with grpo"):
        compute_advantages("grpo", torch.zeros(4), mask_BT, group_size=1, kl_BT=mask_BT, kl_coef=0.1)
    with pytest.raises(ValueError, match="no trained token in sample 1"):
        compute_advantages("reinforce_plus_plus", torch.zeros(2), torch.tensor([[1, 1], [0, 0]]), group_size=1)


def _slime_apply_opd_kl_to_advantages(advantages, student, teacher, kl_coef):
    """slime 624b824 `slime/backends/megatron_utils/loss.py::apply_opd_kl_to_advantages`, per sample as it keeps
    them (lists of response-length tensors)."""
    reverse_kls = []
    for i, adv in enumerate(advantages):
        reverse_kl = student[i] - teacher[i]
        advantages[i] = adv - kl_coef * reverse_kl
        reverse_kls.append(reverse_kl)
    return advantages, reverse_kls


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "ppo"])  # (reinforce++ whitens inside: no base to compare)
def test_on_policy_distillation_subtracts_the_reverse_kl_before_whitening_as_slime(estimator):
    """On random samples of different lengths: the advantages equal slime's estimator, then its OPD term per sample,
    then (here with --normalize-advantages) whitening over every trained token; the returns are untouched."""
    from services.trainer.advantages import opd_term, whiten
    from services.trainer.losses import sample_means

    torch.manual_seed(0)
    lengths = [5, 3, 7, 2]
    mask_BT = torch.zeros(4, 7)
    for i, n in enumerate(lengths):
        mask_BT[i, :n] = 1
    rewards_B, values_BT = torch.rand(4), torch.randn(4, 7)
    student_BT, teacher_BT = -torch.rand(4, 7) * 3, -torch.rand(4, 7) * 3
    base, returns = compute_advantages(estimator, rewards_B, mask_BT, group_size=2, values_BT=values_BT)
    term_BT, reverse_kl_BT = opd_term(student_BT, teacher_BT, mask_BT, 0.7)
    got, got_returns = compute_advantages(estimator, rewards_B, mask_BT, group_size=2, values_BT=values_BT,
                                          opd_BT=term_BT, normalize_advantages=True)  # fmt: skip
    rows = [base[i, :n].clone() for i, n in enumerate(lengths)]
    student, teacher = (
        [student_BT[i, :n] for i, n in enumerate(lengths)],
        [teacher_BT[i, :n] for i, n in enumerate(lengths)],
    )
    expected, reverse_kls = _slime_apply_opd_kl_to_advantages(rows, student, teacher, 0.7)
    expected_BT = torch.zeros(4, 7)
    for i, n in enumerate(lengths):
        expected_BT[i, :n] = expected[i]
    torch.testing.assert_close(got, whiten(expected_BT, mask_BT))
    torch.testing.assert_close(got_returns, returns)
    # opd_reverse_kl as slime reports it: each sample's mean over its tokens (sum_of_sample_mean, per sample)
    slime_metric = torch.stack([r.mean() for r in reverse_kls]).mean()
    torch.testing.assert_close(sample_means(reverse_kl_BT, mask_BT).mean(), slime_metric)
