"""The trainer's losses for one micro-batch: the policy-gradient surrogates (PPO clip with dual-clip, GSPO, CISPO),
KL estimators (unbiased under importance weights), truncated importance sampling, off-policy sequence masking, the
entropy bonus, the critic's value loss, the SFT loss, and the log-probs and entropy of the sampled tokens computed
from the logits chunk by chunk. Semantics follow slime's `ppo_utils.py` and `loss.py`.

Per-token tensors are right-padded `[B, T]` with `loss_mask_BT` (1 on trained tokens), as in `advantages.py`;
padding must hold finite numbers (0 is fine) so that masking by multiplication keeps gradients finite.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from services.trainer.advantages import ESTIMATORS
from services.trainer.config import LossSettings

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGREGATIONS = ("token", "sequence")
LOSS_TYPES = ("policy_loss", "sft_loss")
LOW_VAR_KL_BOUND = 10.0  # slime clamps low_var_kl to [-10, 10]: one token far off the reference cannot blow up a step


def token_logprobs_and_entropy(
    logits_TV: Tensor,
    tokens_T: Tensor,
    chunk_size: int = 1024,
    vocab_start: int | None = None,
    num_valid: int | None = None,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """Float32 log-prob of `tokens_T[t]` under `logits_TV[t]` and the entropy of that row's distribution, `[T]` each.

    `tokens_T` is already aligned with the logits (the token each row predicts). The float32 log-softmax exists for
    one chunk of rows at a time: each chunk is upcast on its own, and under autograd it is recomputed in the backward
    pass instead of being kept, so peak extra memory is one `[chunk_size, V]` float32 block, not `[T, V]`. The
    per-chunk math is `logprobs_and_entropy_chunk`; with `vocab_start` set, the logits are this tensor-parallel rank's
    vocabulary columns `[vocab_start, vocab_start + V)` and `vocab_parallel_chunk` reduces over the TP group. Columns
    from `num_valid` on (Megatron's vocabulary padding) take no probability. `compiled` runs the chunk math through
    torch.compile, which fuses the upcast, softmax, gather and entropy into a few passes over the chunk.
    """
    if logits_TV.dim() != 2 or tokens_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"logits_TV {tuple(logits_TV.shape)} and tokens_T {tuple(tokens_T.shape)} must be [T, V], [T]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    recompute = torch.is_grad_enabled() and logits_TV.requires_grad
    chunk_fn = functools.partial(_compiled_chunk() if compiled else logprobs_and_entropy_chunk, num_valid=num_valid)
    if vocab_start is not None:
        chunk_fn = functools.partial(vocab_parallel_chunk, vocab_start=vocab_start, num_valid=num_valid)
    logprobs, entropies = [], []
    for logits_CV, tokens_C in zip(logits_TV.split(chunk_size), tokens_T.split(chunk_size), strict=True):
        if recompute:
            logprobs_C, entropy_C = checkpoint(chunk_fn, logits_CV, tokens_C, use_reentrant=False)
        else:
            logprobs_C, entropy_C = chunk_fn(logits_CV, tokens_C)
        logprobs.append(logprobs_C)
        entropies.append(entropy_C)
    if not logprobs:
        empty_T = logits_TV.new_zeros(0, dtype=torch.float32)
        return empty_T, empty_T
    return torch.cat(logprobs), torch.cat(entropies)


@functools.cache
def _compiled_chunk():
    return torch.compile(logprobs_and_entropy_chunk, dynamic=True)


def float_logits(logits_CV: Tensor, num_valid: int | None) -> Tensor:
    """The chunk in float32, with padding columns at a very negative (finite: 0 * it stays 0) logit."""
    logits_CV = logits_CV.float()
    if num_valid is not None and num_valid < logits_CV.shape[-1]:
        padding = torch.arange(logits_CV.shape[-1], device=logits_CV.device) >= num_valid
        logits_CV = logits_CV.masked_fill(padding, -1e9)
    return logits_CV


def logprobs_and_entropy_chunk(
    logits_CV: Tensor, tokens_C: Tensor, num_valid: int | None = None
) -> tuple[Tensor, Tensor]:
    """One chunk: log p(token) and -sum p log p per row, in float32 whatever the logits' dtype."""
    logp_CV = F.log_softmax(float_logits(logits_CV, num_valid), dim=-1)
    entropy_C = -(logp_CV.exp() * logp_CV).sum(dim=-1)
    return logp_CV.gather(-1, tokens_C[:, None].long()).squeeze(-1), entropy_C


def vocab_parallel_chunk(
    logits_CV: Tensor, tokens_C: Tensor, vocab_start: int, num_valid: int | None = None
) -> tuple[Tensor, Tensor]:
    """`logprobs_and_entropy_chunk` with the vocabulary split over megatron's tensor-parallel group: the max, the
    partition function, the target logit and E_p[logit] are reduced across ranks, never the `[C, V]` logits. The sums
    go through megatron's reduce-from-TP mapping (all-reduce forward, identity backward), as its cross-entropy does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_tp

    logits_CV = float_logits(logits_CV, num_valid)
    max_C = logits_CV.detach().max(dim=-1).values
    torch.distributed.all_reduce(
        max_C, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    shifted_CV = logits_CV - max_C[:, None]
    exp_CV = shifted_CV.exp()
    sum_exp_C = reduce_tp(exp_CV.sum(dim=-1))
    local_C = tokens_C.long() - vocab_start
    inside_C = (local_C >= 0) & (local_C < logits_CV.shape[-1])
    target_C = shifted_CV.gather(-1, local_C.clamp(0, logits_CV.shape[-1] - 1)[:, None]).squeeze(-1) * inside_C
    log_z_C = sum_exp_C.log()
    expected_C = reduce_tp((exp_CV * shifted_CV).sum(dim=-1)) / sum_exp_C
    return reduce_tp(target_C) - log_z_C, log_z_C - expected_C


def approx_kl(
    logprobs_BT: Tensor, ref_logprobs_BT: Tensor, kl_type: str, importance_ratio_BT: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman's k1, k2, k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with log r = logp - ref_logp; `low_var_kl` is k3
    clamped to [-10, 10]. With `importance_ratio_BT` (pi / pi_old: the tokens were sampled from the old policy) each
    token's estimate is weighed by it before the clamp, which makes it unbiased for the current policy.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_loss_type {kl_type!r} is unknown; expected one of {', '.join(KL_TYPES)}")
    log_ratio_BT = logprobs_BT.float() - ref_logprobs_BT.float()
    if kl_type == "k1":
        kl_BT = log_ratio_BT
    elif kl_type == "k2":
        kl_BT = log_ratio_BT**2 / 2
    else:
        kl_BT = torch.exp(-log_ratio_BT) + log_ratio_BT - 1
    if importance_ratio_BT is not None:
        kl_BT = importance_ratio_BT * kl_BT
    return kl_BT.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND) if kl_type == "low_var_kl" else kl_BT


def opsm_keep(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, loss_mask_BT: Tensor, delta: float
) -> Tensor:
    """Off-policy sequence masking (OPSM): 0 on the negative-advantage tokens of each sample whose mean of
    old_logp - logp over its trained tokens exceeds `delta` (the policy has drifted from the one that sampled it,
    and pushing such a sample down further is what destabilizes training), 1 elsewhere; no gradient."""
    drift_B = sample_means((old_logprobs_BT - logprobs_BT).detach(), loss_mask_BT)
    return 1 - ((advantages_BT < 0) & (drift_B[:, None] > delta)).to(logprobs_BT.dtype)


def sample_means(values_BT: Tensor, loss_mask_BT: Tensor) -> Tensor:
    """Each sample's mean of a per-token quantity over its trained tokens, `[B]` (0 for a sample with none)."""
    mask_BT = loss_mask_BT.to(values_BT.dtype)
    return (values_BT * mask_BT).sum(dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)


def aggregate(values_BT: Tensor, loss_mask_BT: Tensor, loss_aggregation: str = "token") -> Tensor:
    """Mean of a per-token quantity over the trained tokens.

    "token": sum over all trained tokens / their number, so long responses weigh more (slime's
    `--calculate-per-token-loss`). "sequence": the mean within each sample, then the mean over the B samples, so each
    sample weighs the same (slime's default); a sample with no trained token counts as 0.
    """
    if loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation {loss_aggregation!r} is unknown; expected 'token' or 'sequence'")
    if loss_aggregation == "token":
        mask_BT = loss_mask_BT.to(values_BT.dtype)
        return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    return sample_means(values_BT, loss_mask_BT).mean()


def ppo_clip_loss(
    log_ratio_BT: Tensor, advantages_BT: Tensor, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, with optional dual-clip; returns `(pg_loss_BT, clipped_BT)`.

    ratio = exp(log_ratio); loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A). Dual-clip
    (`eps_clip_c` > 1) caps the loss of a negative-advantage token at -eps_clip_c * A = eps_clip_c * |A|, so a token
    whose ratio has run far above 1 cannot dominate the step. `clipped_BT` is 1 where the clipped branch won the max.
    """
    ratio_BT = log_ratio_BT.exp()
    unclipped_BT = -ratio_BT * advantages_BT
    clipped_loss_BT = -ratio_BT.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages_BT
    pg_loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    clipped_BT = (clipped_loss_BT > unclipped_BT).float()
    if eps_clip_c is not None:
        capped_BT = torch.minimum(pg_loss_BT, -eps_clip_c * advantages_BT)
        pg_loss_BT = torch.where(advantages_BT < 0, capped_BT, pg_loss_BT)
    return pg_loss_BT, clipped_BT


def cispo_loss(
    log_ratio_BT: Tensor, logprobs_BT: Tensor, advantages_BT: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp; returns
    `(pg_loss_BT, clipped_BT)`. The weight is clipped under stop-gradient, so clipped tokens still get gradient."""
    ratio_BT = log_ratio_BT.exp()
    weight_BT = ratio_BT.clamp(1 - eps_clip, 1 + eps_clip_high)
    return -weight_BT.detach() * advantages_BT * logprobs_BT, (weight_BT != ratio_BT).float()


def gspo_log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, loss_mask_BT: Tensor) -> Tensor:
    """GSPO's sequence-level log importance ratio, the mean of logp - old_logp over each sample's trained tokens,
    on every token of the sample; the gradient flows to every token through the mean."""
    return sample_means(logprobs_BT - old_logprobs_BT, loss_mask_BT)[:, None].expand_as(logprobs_BT)


def tis_weights(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, tis_clip: float, tis_clip_low: float
) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling: exp(old_logp - rollout_logp) clipped to [tis_clip_low, tis_clip], detached;
    returns `(weights_BT, clipped_BT)`. It corrects for the rollout engine sampling from a slightly different
    distribution than the trainer's (old) policy computes."""
    ratio_BT = torch.exp(old_logprobs_BT.float() - rollout_logprobs_BT.float()).detach()
    weights_BT = ratio_BT.clamp(tis_clip_low, tis_clip)
    return weights_BT, (weights_BT != ratio_BT).float()


def sft_loss(logprobs_BT: Tensor, loss_mask_BT: Tensor, loss_aggregation: str = "token") -> Tensor:
    """Negative mean log-likelihood of the trained tokens."""
    return -aggregate(logprobs_BT, loss_mask_BT, loss_aggregation)


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    loss_mask_BT: Tensor,
    value_clip: float,
    loss_aggregation: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), so the value
    cannot move more than `value_clip` from the rollout's value in one update; returns `(loss, metrics)`."""
    _check_shapes(loss_mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-value_clip, value_clip)
    loss_BT = 0.5 * torch.maximum((values_BT - returns_BT) ** 2, (clipped_BT - returns_BT) ** 2)
    loss = aggregate(loss_BT, loss_mask_BT, loss_aggregation)
    clipfrac = aggregate(((values_BT - old_values_BT).abs() > value_clip).float(), loss_mask_BT, loss_aggregation)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


def policy_loss(
    logprobs_BT: Tensor,
    loss_mask_BT: Tensor,
    settings: LossSettings | None = None,
    *,
    old_logprobs_BT: Tensor | None = None,
    advantages_BT: Tensor | None = None,
    entropy_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    rollout_logprobs_BT: Tensor | None = None,
    loss_aggregation: str = "token",
    tis_function: Callable | None = None,
    **overrides: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss for one micro-batch and its metrics (detached scalars), under the loss `settings` (slime's
    names; the config's `loss`, its defaults when None), with `overrides` of single settings (`eps_clip=0.3`).

    loss_type "sft_loss" is `sft_loss` (plus the KL loss if asked). "policy_loss" is the surrogate of the
    estimator (PPO clip, GSPO's sequence ratio, or CISPO), times the TIS weights when `use_tis`, aggregated, minus
    `entropy_coef` * mean entropy, plus `kl_loss_coef` * mean KL to `ref_logprobs_BT` when `use_kl_loss`.
    `use_rollout_logprobs` takes the rollout engine's log-probs as the old policy instead of the trainer's
    recomputed `old_logprobs_BT` (slime forbids combining it with TIS, which needs both). `tis_function(pg_loss_BT,
    old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT) -> (pg_loss_BT, kept_mask_BT, metrics_BT)` replaces the
    TIS weights (a custom TIS: `hooks.py`); its metrics are averaged over the trained tokens before its mask.
    """
    s = _settings(settings, overrides)
    tensors = {k: v for k, v in locals().items() if k.endswith("_BT")}
    _check_policy_args(s, loss_aggregation, tensors)  # by name, before any compute
    if s.use_rollout_logprobs:
        old_logprobs_BT = rollout_logprobs_BT
    if s.loss_type == "sft_loss":
        loss = sft_loss(logprobs_BT, loss_mask_BT, loss_aggregation)
        metrics = {"sft_loss": loss.detach()}
    else:
        loss, metrics = _surrogate_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages_BT,
            loss_mask_BT,
            rollout_logprobs_BT=rollout_logprobs_BT if s.use_tis else None,
            advantage_estimator=s.advantage_estimator,
            clip=(s.eps_clip, s.eps_clip if s.eps_clip_high is None else s.eps_clip_high, s.eps_clip_c),
            tis_clip=(s.tis_clip_low, s.tis_clip),
            loss_aggregation=loss_aggregation,
            tis_function=tis_function,
            opsm_delta=s.opsm_delta if s.use_opsm else None,
        )
    if entropy_BT is not None:
        entropy = aggregate(entropy_BT, loss_mask_BT, loss_aggregation)
        loss = loss - s.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    if s.use_kl_loss:
        ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT.detach()) if s.use_unbiased_kl else None
        kl_BT = approx_kl(logprobs_BT, ref_logprobs_BT, s.kl_loss_type, ratio_BT)
        kl_loss = aggregate(kl_BT, loss_mask_BT, loss_aggregation)
        loss = loss + s.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def _settings(settings: LossSettings | None, overrides: dict[str, Any]) -> LossSettings:
    """`settings` with `overrides`, unvalidated: `_check_policy_args` checks them with the argument named."""
    unknown = sorted(set(overrides) - set(LossSettings.model_fields))
    if unknown:
        raise TypeError(
            f"policy_loss got unexpected arguments {', '.join(unknown)}; the loss settings are LossSettings'"
        )
    return (settings or LossSettings()).model_copy(update=overrides)


def _surrogate_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    loss_mask_BT: Tensor,
    *,
    rollout_logprobs_BT: Tensor | None,
    advantage_estimator: str,
    clip: tuple[float, float, float | None],
    tis_clip: tuple[float, float],
    loss_aggregation: str,
    tis_function: Callable | None = None,
    opsm_delta: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The aggregated policy-gradient loss and its metrics. `clip` is (eps_clip, eps_clip_high, eps_clip_c),
    `tis_clip` (low, high); TIS applies when `rollout_logprobs_BT` is given, OPSM when `opsm_delta` is."""
    eps_clip, eps_clip_high, eps_clip_c = clip
    old_logprobs_BT = old_logprobs_BT.detach()
    if advantage_estimator == "gspo":
        log_ratio_BT = gspo_log_ratio(logprobs_BT, old_logprobs_BT, loss_mask_BT)
    else:
        log_ratio_BT = logprobs_BT - old_logprobs_BT
    if advantage_estimator == "cispo":
        pg_loss_BT, clipped_BT = cispo_loss(log_ratio_BT, logprobs_BT, advantages_BT, eps_clip, eps_clip_high)
    else:
        pg_loss_BT, clipped_BT = ppo_clip_loss(log_ratio_BT, advantages_BT, eps_clip, eps_clip_high, eps_clip_c)
    metrics: dict[str, Tensor] = {}
    if opsm_delta is not None:
        keep_BT = opsm_keep(logprobs_BT, old_logprobs_BT, advantages_BT, loss_mask_BT, opsm_delta)
        pg_loss_BT = pg_loss_BT * keep_BT
        metrics["opsm_clipfrac"] = aggregate(1 - keep_BT, loss_mask_BT, loss_aggregation)
    if rollout_logprobs_BT is not None and tis_function is not None:
        pg_loss_BT, kept_BT, extra = tis_function(pg_loss_BT, old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT)
        pg_loss_BT = pg_loss_BT * kept_BT  # rejected tokens add nothing; the mean stays over the trained tokens
        metrics.update({k: aggregate(v.detach(), loss_mask_BT, loss_aggregation) for k, v in extra.items()})
    elif rollout_logprobs_BT is not None:
        weights_BT, tis_clipped_BT = tis_weights(old_logprobs_BT, rollout_logprobs_BT, tis_clip[1], tis_clip[0])
        pg_loss_BT = pg_loss_BT * weights_BT
        metrics["tis"] = aggregate(weights_BT, loss_mask_BT, loss_aggregation)
        metrics["tis_clipfrac"] = aggregate(tis_clipped_BT, loss_mask_BT, loss_aggregation)
    pg_loss = aggregate(pg_loss_BT, loss_mask_BT, loss_aggregation)
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = aggregate(clipped_BT, loss_mask_BT, loss_aggregation)
    metrics["ppo_kl"] = aggregate(-log_ratio_BT.detach(), loss_mask_BT, loss_aggregation)  # slime's sign: old - new
    return pg_loss, metrics


def _check_policy_args(s: LossSettings, loss_aggregation: str, tensors: dict[str, Tensor | None]) -> None:
    """Validates `policy_loss`'s arguments, naming the one at fault."""
    for name, value, allowed in (
        ("loss_type", s.loss_type, LOSS_TYPES),
        ("loss_aggregation", loss_aggregation, LOSS_AGGREGATIONS),
        ("kl_loss_type", s.kl_loss_type, KL_TYPES),
        ("advantage_estimator", s.advantage_estimator, ESTIMATORS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} {value!r} is unknown; expected one of {', '.join(allowed)}")
    given = {name: value for name, value in tensors.items() if value is not None}
    _check_shapes(given.pop("loss_mask_BT"), **given)
    needs = [
        ("old_logprobs_BT", s.loss_type == "policy_loss" and not s.use_rollout_logprobs, "policy_loss"),
        ("old_logprobs_BT", s.use_kl_loss and s.use_unbiased_kl and not s.use_rollout_logprobs, "use_unbiased_kl"),
        ("advantages_BT", s.loss_type == "policy_loss", "policy_loss"),
        ("ref_logprobs_BT", s.use_kl_loss, "use_kl_loss"),
        ("rollout_logprobs_BT", s.use_tis or s.use_rollout_logprobs, "use_tis / use_rollout_logprobs"),
        ("entropy_BT", s.entropy_coef != 0, "entropy_coef != 0"),
    ]
    for name, needed, reason in needs:
        if needed and tensors[name] is None:
            raise ValueError(f"{name} is required with {reason}")
    _check_clip_args(s)


def _check_clip_args(s: LossSettings) -> None:
    if s.use_tis and s.use_rollout_logprobs:
        raise ValueError("use_tis and use_rollout_logprobs cannot both be set: TIS reweights old by rollout log-probs")
    if s.eps_clip < 0 or (s.eps_clip_high is not None and s.eps_clip_high < 0):
        raise ValueError(f"eps_clip {s.eps_clip} and eps_clip_high {s.eps_clip_high} must be >= 0")
    if s.eps_clip_c is not None and s.eps_clip_c <= 1:
        raise ValueError(f"eps_clip_c must be greater than 1 for dual-clip PPO, got {s.eps_clip_c}")
    if s.use_tis and not 0 <= s.tis_clip_low <= s.tis_clip:
        raise ValueError(f"need 0 <= tis_clip_low <= tis_clip, got {s.tis_clip_low} and {s.tis_clip}")


def _check_shapes(loss_mask_BT: Tensor, **tensors: Tensor) -> None:
    if loss_mask_BT.dim() != 2:
        raise ValueError(f"loss_mask_BT must be [B, T], got shape {tuple(loss_mask_BT.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != loss_mask_BT.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, loss_mask_BT {tuple(loss_mask_BT.shape)}")
