"""The PPO critic: the policy's architecture (started from the same checkpoint) with a scalar value head in place of
the output layer, trained on the GAE returns with the clipped value loss. It runs the actor's step machinery
(micro-batches, loss shares across data-parallel ranks, gradient reduction and clipping) with its own loss."""

import torch

from services.trainer.actor import Actor
from services.trainer.data import RolloutBatch
from services.trainer.losses import value_loss


class ValueHead(torch.nn.Module):
    """Stands where GPTModel's output layer was: hidden `[s, b, h]` → values `[s, b, 1]` (replicated over TP ranks,
    whose hidden states are whole)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)  # starts at V = 0: the first advantages are the plain returns
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return self.linear(hidden), None


def load_critic(hf_dir: str, dtype: torch.dtype, **transformer_settings):
    from services.trainer.models import load_gpt_model

    model, gpt = load_gpt_model(hf_dir, dtype=dtype, **transformer_settings)
    if getattr(model, "post_process", True):
        device = next(model.parameters()).device
        model.output_layer = ValueHead(gpt.shape.hidden_size).to(device=device, dtype=dtype)
    return model, gpt


class Critic(Actor):
    """`train_step(batch, indices, tensors)` with tensors holding `old_values`, `returns` and `mask` `[B, R]`."""

    def values(self, model, batch: RolloutBatch, indices: list[int]) -> torch.Tensor:
        """`[b, R]` values of the states before each response token."""
        inputs = self.inputs(batch, indices)
        values_BL = self.forward(model, inputs)[..., 0].float()
        spans = inputs["spans"]
        width = max(end - start for start, end in spans)
        rows = [values_BL[b, start - 1 : end - 1] for b, (start, end) in enumerate(spans)]
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])

    @torch.no_grad()
    def full_values(self, batch: RolloutBatch) -> torch.Tensor:
        width = max(batch.response_lengths())
        out = torch.zeros(len(batch), width)
        for indices in self._micro_batches(batch, list(range(len(batch)))):
            v = self.values(self.model, batch, indices)
            out[indices, : v.shape[1]] = v.cpu()
        return out

    def micro_batch_loss(self, batch: RolloutBatch, mb: list[int], t: dict, share: dict):
        values_bR = self.values(self.model, batch, mb)
        width = values_bR.shape[1]
        take = {k: t[k][mb, :width].to(self.device) for k in ("old_values", "returns", "mask")}
        loss, metrics = value_loss(
            values_bR,
            take["old_values"],
            take["returns"],
            take["mask"],
            self.config.value_clip,
            loss_aggregation="token" if share["token_level"] else "sequence",
        )
        part = (float(take["mask"].sum()) if share["token_level"] else float(len(mb))) / share["total"]
        return loss * part, {f"critic/{name}": float(value) * part for name, value in metrics.items()}
