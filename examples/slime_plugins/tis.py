"""A custom TIS (`--use-tis --custom-tis-function-path examples/slime_plugins/tis.py:icepop`) written as slime's
are: `fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> (pg_loss, loss_masks,
metrics)`, per-token values as the micro-batch's response tokens one after another.

IcePop: a token whose ratio between the trainer's and the engine's probability is outside [tis_clip_low, tis_clip]
gets weight 0 (it is dropped from the loss), the others the ratio itself.
"""

import torch


def icepop(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    kept = (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip)
    weights = torch.where(kept, ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (~kept).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weights, loss_masks, metrics
