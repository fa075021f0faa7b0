"""Advantage estimators: turn each sample's scalar reward (samples grouped by prompt) into per-token advantages and
returns, once per rollout batch, before the policy update. Semantics follow slime's `ppo_utils.py` and
`compute_advantages_and_returns`.

Representation: per-token tensors are right-padded to `[B, T]` and come with `loss_mask_BT` (1 where the token was
sampled by the policy and is trained on; 0 for padding and for masked spans such as tool output). The samples of one
prompt are contiguous, `group_size` of them (slime's `--n-samples-per-prompt`). Outputs are float32 and 0 wherever
`loss_mask_BT` is 0.
"""

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
GROUP_STD_EPS = 1e-6  # slime's: keeps a group whose rewards are all equal at advantage 0, not NaN
WHITEN_EPS = 1e-8  # slime's distributed_masked_whiten


def compute_advantages(
    advantage_estimator: str,
    rewards_B: Tensor,
    loss_mask_BT: Tensor,
    *,
    group_size: int,
    kl_BT: Tensor | None = None,
    values_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    disable_std_normalization: bool = False,
    normalize_advantages: bool = False,
    rewards_normalization: bool = True,
    opd_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns `(advantages_BT, returns_BT)` for slime's `--advantage-estimator`.

    grpo / gspo / cispo: the group-normalised reward on every token (GSPO and CISPO differ only in the loss).
    ppo: GAE(gamma, lambd) over `values_BT` (the critic's, per token); returns = advantages + values.
    reinforce_plus_plus: discounted (gamma) return of the token rewards. reinforce_plus_plus_baseline: the reward
    minus its group mean, minus `kl_coef * kl` per token. Both reinforce++ variants are always whitened (slime
    refuses to run them without `--normalize-advantages`); `returns_BT` is the value before whitening.
    `kl_BT` is the per-token KL to the reference policy (`losses.approx_kl`), needed when `kl_coef` is not 0.
    Without `rewards_normalization` the rewards are taken as already normalized (slime's
    `--disable-rewards-normalization`, or a custom reward post-processing): no group statistics are applied.
    `opd_BT`, on-policy distillation's term (`opd_term`), is subtracted from the advantages (not the returns)
    before they are whitened, as slime's `apply_opd_kl_to_advantages`.
    """
    mask_BT = _checked_mask(advantage_estimator, rewards_B, loss_mask_BT, group_size, kl_BT, values_BT, kl_coef)
    rewards_B = rewards_B.to(torch.float32)
    kl_BT = torch.zeros_like(mask_BT) if kl_BT is None else kl_BT.to(torch.float32) * mask_BT
    if rewards_normalization:
        rewards_B = normalized_rewards(advantage_estimator, rewards_B, group_size, not disable_std_normalization)
    if advantage_estimator in ("grpo", "gspo", "cispo"):
        advantages_BT = returns_BT = rewards_B[:, None] * mask_BT
    elif advantage_estimator == "ppo":
        rewards_BT = token_level_rewards(rewards_B, mask_BT, kl_BT, kl_coef)
        advantages_BT, returns_BT = gae(rewards_BT, values_BT.to(torch.float32), mask_BT, gamma, lambd)
    elif advantage_estimator == "reinforce_plus_plus":
        rewards_BT = token_level_rewards(rewards_B, mask_BT, kl_BT, kl_coef)
        advantages_BT = returns_BT = discounted_returns(rewards_BT, gamma) * mask_BT
    else:
        advantages_BT = returns_BT = (rewards_B[:, None] - kl_coef * kl_BT) * mask_BT
    if opd_BT is not None:
        advantages_BT = (advantages_BT - opd_BT) * mask_BT
    if normalize_advantages or advantage_estimator.startswith("reinforce_plus_plus"):
        advantages_BT = whiten(advantages_BT, mask_BT)
    return advantages_BT, returns_BT


def opd_term(student_BT: Tensor, teacher_BT: Tensor, mask_BT: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """On-policy distillation (slime's `apply_opd_kl_to_advantages`): `kl_coef` * the reverse KL per token,
    (student - teacher) log-prob, the student's being the old policy's (the rollout engine's with
    --use-rollout-logprobs); returns (the term, the reverse KL), both 0 on untrained tokens."""
    reverse_kl_BT = (student_BT.float() - teacher_BT.float()) * mask_BT
    return kl_coef * reverse_kl_BT, reverse_kl_BT


def normalized_rewards(estimator: str, rewards_B: Tensor, group_size: int, std_normalization: bool = True) -> Tensor:
    """slime's reward post-processing before the estimator: grpo, gspo and cispo take the group-normalized reward,
    the reinforce++ baseline the reward minus its group mean, the others the reward as it is."""
    rewards_B = rewards_B.to(torch.float32)
    if estimator in ("grpo", "gspo", "cispo"):
        return group_normalized_rewards(rewards_B, group_size, std_normalization=std_normalization)
    if estimator == "reinforce_plus_plus_baseline":
        return group_normalized_rewards(rewards_B, group_size, std_normalization=False)
    return rewards_B


def group_normalized_rewards(rewards_B: Tensor, group_size: int, *, std_normalization: bool = True) -> Tensor:
    """(r - group mean) / (group std + 1e-6), the std unbiased (torch.std, as slime); without `std_normalization`
    (Dr.GRPO, and the reinforce++ baseline) just r - group mean. A group of one has no std, so it is not divided."""
    groups_GN = rewards_B.view(-1, group_size)
    centered_GN = groups_GN - groups_GN.mean(dim=-1, keepdim=True)
    if std_normalization and group_size > 1:
        centered_GN = centered_GN / (groups_GN.std(dim=-1, keepdim=True) + GROUP_STD_EPS)
    return centered_GN.reshape(-1)


def token_level_rewards(rewards_B: Tensor, mask_BT: Tensor, kl_BT: Tensor, kl_coef: float) -> Tensor:
    """-kl_coef * kl on every trained token, plus the sample's reward on its last trained token."""
    rewards_BT = -kl_coef * kl_BT * mask_BT
    rewards_BT[torch.arange(len(rewards_B)), last_token_index(mask_BT)] += rewards_B
    return rewards_BT


def last_token_index(mask_BT: Tensor) -> Tensor:
    """Index of each row's last trained token; -1 for a row with none."""
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    return torch.where(mask_BT > 0, positions_BT, -1).max(dim=-1).values


def gae(rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns `(advantages_BT, returns_BT)`.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lambd * A_{t+1}. Values after a row's last
    trained token are taken as 0 (whatever the padding holds), so the episode ends there.
    """
    alive_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device) <= last_token_index(mask_BT)[:, None]
    values_BT = values_BT * alive_BT
    next_values_BT = torch.nn.functional.pad(values_BT[:, 1:], (0, 1))
    deltas_BT = rewards_BT + gamma * next_values_BT - values_BT
    advantages_BT = discounted_returns(deltas_BT, gamma * lambd)
    return advantages_BT * mask_BT, (advantages_BT + values_BT) * mask_BT


def discounted_returns(rewards_BT: Tensor, discount: float, chunk_size: int = 128) -> Tensor:
    """G_t = r_t + discount * G_{t+1}, right to left along T.

    Within a chunk the sum is one matmul with a [C, C] matrix of discount powers, so only the carry between chunks is
    sequential: a 32k-token response takes T / C steps, not T. The matmul runs in float64 because TF32 matmuls
    (enabled in many training setups) would lose three decimal digits of the returns.
    """
    num_rows, num_tokens = rewards_BT.shape
    chunk = max(1, min(chunk_size, num_tokens))
    padded_BT = torch.nn.functional.pad(rewards_BT.double(), (0, -num_tokens % chunk))  # zeros add nothing
    chunks_BNC = padded_BT.view(num_rows, -1, chunk)
    idx_C = torch.arange(chunk, device=rewards_BT.device)
    gap_CC = idx_C[:, None] - idx_C[None, :]  # [s, t]: how far reward s lies after token t
    powers_CC = torch.where(gap_CC >= 0, discount ** gap_CC.clamp(min=0).double(), 0.0)
    local_BNC = chunks_BNC @ powers_CC
    carry_decay_C = discount ** (chunk - idx_C).double()
    out_BNC = torch.empty_like(local_BNC)
    carry_B = padded_BT.new_zeros(num_rows)
    for n in reversed(range(chunks_BNC.shape[1])):
        out_BNC[:, n] = local_BNC[:, n] + carry_B[:, None] * carry_decay_C
        carry_B = out_BNC[:, n, 0]
    return out_BNC.reshape(num_rows, -1)[:, :num_tokens].to(rewards_BT.dtype)


def whiten(values_BT: Tensor, mask_BT: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the trained tokens of the whole batch, with the unbiased variance (slime's
    Bessel-corrected `distributed_masked_whiten`); 0 on untrained tokens."""
    num_tokens = mask_BT.sum()
    if num_tokens == 0:
        raise ValueError("loss_mask_BT has no trained tokens; cannot normalise advantages over an empty batch")
    mean = (values_BT * mask_BT).sum() / num_tokens
    var = (((values_BT - mean) * mask_BT) ** 2).sum() / (num_tokens - 1 if num_tokens > 1 else num_tokens)
    return (values_BT - mean) * torch.rsqrt(var + eps) * mask_BT


def _checked_mask(
    estimator: str,
    rewards_B: Tensor,
    loss_mask_BT: Tensor,
    group_size: int,
    kl_BT: Tensor | None,
    values_BT: Tensor | None,
    kl_coef: float,
) -> Tensor:
    """Validates the inputs of `compute_advantages`, naming the argument at fault; returns the mask as float32."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage_estimator {estimator!r} is unknown; expected one of {', '.join(ESTIMATORS)}")
    _check_rewards(rewards_B, group_size)
    if loss_mask_BT.dim() != 2 or loss_mask_BT.shape[0] != rewards_B.shape[0]:
        raise ValueError(f"loss_mask_BT has shape {tuple(loss_mask_BT.shape)}; expected [{rewards_B.shape[0]}, T]")
    for name, tensor in (("kl_BT", kl_BT), ("values_BT", values_BT)):
        if tensor is not None and tensor.shape != loss_mask_BT.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, loss_mask_BT {tuple(loss_mask_BT.shape)}")
    if estimator == "ppo" and values_BT is None:
        raise ValueError("advantage_estimator 'ppo' needs values_BT, the critic's per-token values")
    if kl_coef != 0 and estimator in ("grpo", "gspo", "cispo"):
        raise ValueError(f"kl_coef={kl_coef} has no effect with {estimator}; use use_kl_loss / kl_loss_coef instead")
    if kl_coef != 0 and kl_BT is None:
        raise ValueError(f"kl_coef={kl_coef} needs kl_BT, the per-token KL to the reference policy")
    mask_BT = loss_mask_BT.to(torch.float32)
    if estimator in ("ppo", "reinforce_plus_plus"):
        empty = (mask_BT.sum(dim=-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"loss_mask_BT has no trained token in sample {empty[0]}; its reward has nowhere to go")
    return mask_BT


def _check_rewards(rewards_B: Tensor, group_size: int) -> None:
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D (one reward per sample), got shape {tuple(rewards_B.shape)}")
    nan = torch.isnan(rewards_B).nonzero().flatten().tolist()
    if nan:
        raise ValueError(f"rewards contain NaN at sample {nan[0]}")
    if group_size < 1 or rewards_B.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the {rewards_B.shape[0]} samples; pass n_samples_per_prompt "
            "and keep each prompt's samples together"
        )
