"""One rollout's training on this rank: log-probs of the old policy and the reference model, advantages, then
`num_steps_per_rollout` optimizer steps over micro-batches, with gradients summed across data-parallel ranks by
megatron's DistributedDataParallel (`data_parallel.py`).

Every micro-batch's loss is scaled by its share of the step's trained tokens (or samples, for sequence-level
aggregation) across all data-parallel ranks, so the summed gradient is that of the loss over the whole global batch,
whatever the micro-batch and rank sizes.
"""

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from services.trainer.advantages import compute_advantages, normalized_rewards, opd_term, whiten
from services.trainer.batching import micro_batches, split_steps
from services.trainer.config import TrainerConfig
from services.trainer.data import BatchError, RolloutBatch, input_tensors, pad_rows, response_tensors
from services.trainer.data_parallel import DistributedAdamW
from services.trainer.hooks import Hooks
from services.trainer.linear_logprobs import hidden_states_out, linear_logprobs_and_entropy
from services.trainer.losses import approx_kl, policy_loss, sample_means, token_logprobs_and_entropy
from services.trainer.optimizer import clip_gradients

log = logging.getLogger(__name__)
VOCAB_CHUNK = 8192  # --log-probs-from-hidden: words whose float32 logits exist at once (TRL's chunk)


@dataclass
class Groups:
    """The process groups a step reduces over (None: a world of one)."""

    dp: object = None
    tp: object = None
    tp_rank: int = 0
    vocab_start: int | None = None  # set when the output layer is split over TP ranks
    vocab_size: int | None = None  # the real vocabulary: Megatron pads the output layer beyond it
    model_parallel: object = None  # TP x PP: where the gradient norm is summed (defaults to the TP group)
    expert_model_parallel: object = None  # MoE: expert-tensor x expert x pipeline ranks, where experts' norms sum
    embedding: object = None  # tied embeddings with pipeline stages: the first and last stages, which share a weight


class Actor:
    """Trains `model` with `optimizer` and `scheduler`; `ddp` (`data_parallel.build`), megatron's DDP around `model`,
    sums the gradients over data-parallel ranks and may be left out only where there is one."""

    def __init__(self, config: TrainerConfig, model, optimizer, scheduler, groups: Groups, ref_model=None, ddp=None):
        self.config, self.model, self.optimizer, self.scheduler = config, model, optimizer, scheduler
        self.groups, self.ref_model, self.ddp = groups, ref_model, ddp
        self.hooks = Hooks(config)  # slime's extension points: loss, advantages, TIS, reward post-processing
        if ddp is None and groups.dp is not None and dist.get_world_size(groups.dp) > 1:
            raise ValueError(
                "data-parallel ranks sum their gradients through megatron's DDP: pass the actor "
                "ddp=data_parallel.wrap(model, config)"
            )
        if ddp is not None and self.pipelined:  # the schedule lets the DDP reduce after the last micro-batch only
            model.config.no_sync_func = ddp.no_sync
        self.critic = None  # PPO: a Critic trained beside the policy
        self.teacher = None  # on-policy distillation with --opd-type megatron: the teacher model, forward only
        self.budget_chosen = False  # --max-tokens-per-gpu chosen from the free memory (token_budget.py)
        self.from_hidden = from_hidden(config, model)
        self.routing = None
        self._agreeing: list | None = None  # a rollout's first step's (|log-prob difference|, mask) a micro-batch
        if config.replays_routing:
            from services.trainer.routing_replay import RoutingReplay

            self.routing = RoutingReplay()
        self.device = next(model.parameters()).device
        if config.compile_model:
            self._compile_layers(model)

    @staticmethod
    def _compile_layers(model) -> None:
        """torch.compile of each decoder layer; of an MoE layer its attention only (its token dispatcher reads token
        counts on the host). Of multi-latent attention all but its core attention, which inductor fails to partition
        for backward (its keys and values differ in head size): that part runs eagerly between two compiled ones."""
        latent = getattr(getattr(model, "config", None), "multi_latent_attention", False)
        for layer in getattr(getattr(model, "decoder", None), "layers", []):
            attention = layer.self_attention
            if latent:
                attention.core_attention.forward = torch.compiler.disable(attention.core_attention.forward)
            (attention if hasattr(getattr(layer, "mlp", None), "router") else layer).compile()

    # Log-probs

    @property
    def _num_valid(self) -> int | None:
        """How many of this rank's output columns are real vocabulary (the rest is Megatron's padding)."""
        if self.groups.vocab_size is None:
            return None
        return max(0, self.groups.vocab_size - (self.groups.vocab_start or 0))

    def inputs(self, batch: RolloutBatch, indices: list[int], length: int | None = None) -> dict[str, torch.Tensor]:
        """Model inputs of samples `indices` on this rank's device, right-padded to `length` when given, and `spans`:
        each sample's response as (start, end) on the host, so that nothing waits for the device to read them. The
        copies to the device do not wait for it either (the host's tensors are staged at once)."""
        inputs = input_tensors(batch, indices)
        tp = self.config.parallel.tensor_model_parallel_size
        if self.config.parallel.sequence_parallel and tp > 1:  # the sequence is split over the TP ranks
            length = -(-(length or inputs["tokens_BL"].shape[1]) // tp) * tp
        if length is not None:
            pad = length - inputs["tokens_BL"].shape[1]
            inputs["tokens_BL"] = torch.nn.functional.pad(inputs["tokens_BL"], (0, pad))
            inputs["positions_BL"] = torch.arange(length).expand(len(indices), length).contiguous()
        spans = list(zip(inputs["prompt_lengths_B"].tolist(), inputs["lengths_B"].tolist(), strict=True))
        return {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()} | {"spans": spans}

    def forward(self, model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        config = getattr(model, "config", None)
        # Padding is routed like any token but kept out of the routers' auxiliary losses. (Only where they exist:
        # megatron-core 0.16.1's expert-bias token count cannot take the mask.)
        if not getattr(config, "moe_aux_loss_coeff", 0) and not getattr(config, "moe_z_loss_coeff", None):
            return model(input_ids=inputs["tokens_BL"], position_ids=inputs["positions_BL"], attention_mask=None)
        padding = inputs["positions_BL"] >= inputs["lengths_B"][:, None]
        return model(
            input_ids=inputs["tokens_BL"],
            position_ids=inputs["positions_BL"],
            attention_mask=None,
            padding_mask=padding,
        )

    def response_logprobs(self, logits_BLV: torch.Tensor, inputs: dict[str, torch.Tensor]):
        """`[b, R]` log-probs and entropies of the response tokens, from the model's logits `[b, L, V]`."""
        spans = inputs["spans"]
        width = max(end - start for start, end in spans)
        logprobs, entropies = [], []
        for b, (start, end) in enumerate(spans):
            rows = logits_BLV[b, start - 1 : end - 1]  # the logits at t predict token t + 1
            lp, ent = token_logprobs_and_entropy(
                rows,
                inputs["tokens_BL"][b, start:end],
                self.config.log_probs_chunk_size,
                self.groups.vocab_start,
                self._num_valid,
                compiled=self.config.compile_model,
            )
            logprobs.append(torch.nn.functional.pad(lp, (0, width - len(lp))))
            entropies.append(torch.nn.functional.pad(ent, (0, width - len(ent))))
        return torch.stack(logprobs), torch.stack(entropies)

    def logprobs(self, model, batch: RolloutBatch, indices: list[int], entropy: bool = False):
        """`[b, R]` log-probs (and entropies) of the response tokens of samples `indices` under `model`."""
        inputs = self.inputs(batch, indices)
        if self.from_hidden and not self.pipelined:  # a pipeline's stages keep the logits' path
            with hidden_states_out(model) as weight:
                hidden_BLH = self.forward(model, inputs)
            logprobs, entropies = self.response_logprobs_from_hidden(hidden_BLH, weight[0], inputs)
        else:
            logprobs, entropies = self.response_logprobs(self.forward(model, inputs), inputs)
        return logprobs, (entropies if entropy else None)

    def response_logprobs_from_hidden(self, hidden_BLH: torch.Tensor, weight_VH: torch.Tensor, inputs: dict):
        """`[b, R]` log-probs and entropies of the response tokens from the last hidden states and the output
        layer's weight (this rank's vocabulary slice), with no logits but a block's (--log-probs-from-hidden)."""
        spans = inputs["spans"]
        rows_TH = torch.cat([hidden_BLH[b, start - 1 : end - 1] for b, (start, end) in enumerate(spans)])
        tokens_T = torch.cat([inputs["tokens_BL"][b, start:end] for b, (start, end) in enumerate(spans)])
        group = None
        if self.groups.vocab_start is not None:  # the vocabulary split over the tensor-parallel ranks
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        logprobs_T, entropy_T = linear_logprobs_and_entropy(rows_TH, weight_VH, tokens_T, VOCAB_CHUNK,
                                                            self.groups.vocab_start or 0, self.groups.vocab_size,
                                                            group)  # fmt: skip
        counts = [end - start for start, end in spans]
        pad = torch.nn.utils.rnn.pad_sequence
        return pad(logprobs_T.split(counts), batch_first=True), pad(entropy_T.split(counts), batch_first=True)

    @torch.no_grad()
    def full_logprobs(self, model, batch: RolloutBatch, mbs: list[list[int]] | None = None, routing: str = ""):
        """`[B, R]` log-probs of the whole rank's batch (old policy or reference), micro-batch by micro-batch (`mbs`,
        by default the batch's; `routing` "record": the routers record their choices for routing replay, "replay":
        they route as recorded). With pipeline parallelism only the last stage has them (the others get zeros, and
        do not need them)."""
        width = max(batch.response_lengths())
        out = torch.zeros(len(batch), width)
        mbs = mbs or self._micro_batches(batch, list(range(len(batch))))
        if self.pipelined:
            from services.trainer.pipeline import pipeline_logprobs

            for indices, lp in zip(mbs, pipeline_logprobs(self, model, batch, mbs), strict=True):
                out[indices, : lp.shape[1]] = lp.float().cpu()
            return out
        for indices in mbs:
            with getattr(self.routing, routing)(indices) if routing else contextlib.nullcontext():
                lp, _ = self.logprobs(model, batch, indices)
            out[indices, : lp.shape[1]] = lp.float().cpu()
        return out

    # Training

    def train_rollout(self, batch: RolloutBatch, rollout: int = 0) -> list[dict[str, float]]:
        """Trains on one rollout (the `rollout`-th of the run); returns each optimizer step's metrics."""
        c = self.config
        tensors = response_tensors(batch)
        mask_BR = tensors["loss_mask_BR"]
        self.model.eval()  # the old policy's log-probs: no dropout
        steps = split_steps(list(range(len(batch))), c.num_steps_per_rollout)
        old_BR = self._old_logprobs(batch, steps, tensors["rollout_logprobs_BR"])
        ref_BR = self._reference_logprobs(batch)
        values_BR = self.critic.full_values(batch) if self.critic is not None else None
        kl_BR = approx_kl(old_BR, ref_BR, "k1") * mask_BR if ref_BR is not None and c.kl_coef else None
        opd_BR, opd_metrics = None, {}
        if c.use_opd:
            opd_BR, reverse_kl_BR = opd_term(old_BR, self._teacher_logprobs(batch, mask_BR), mask_BR, c.opd_kl_coef)
            opd_metrics = {"opd_reverse_kl": self._dp_mean(sample_means(reverse_kl_BR, mask_BR))}
        rewards_B = batch.rewards_B
        if not (batch.normalized or c.disable_rewards_normalization):
            std = not c.disable_grpo_std_normalization
            rewards_B = normalized_rewards(c.loss.advantage_estimator, rewards_B, batch.group_size, std)
        per_step = {
            "old": old_BR,
            "ref": ref_BR,
            "mask": mask_BR,
            "rollout": tensors["rollout_logprobs_BR"],
            "rewards": rewards_B,
        }
        given_B = [len(lp) == n for lp, n in zip(batch.rollout_logprobs, batch.response_lengths(), strict=True)]
        engine_mask_BR = mask_BR * torch.tensor(given_B, dtype=mask_BR.dtype)[:, None]  # tokens with the engine's
        if c.loss.use_rollout_logprobs:  # no log-probs of the old policy here: the first step's forward gives them
            per_step["engine_mask"], self._agreeing = engine_mask_BR, []
            agreement = {}
        else:
            agreement = self._agreement([((old_BR - per_step["rollout"]).abs(), engine_mask_BR)])
        if self.hooks["custom_advantage_function_path"]:
            kl = kl_BR if kl_BR is not None else torch.zeros_like(mask_BR)
            advantages_BR, returns_BR = self.hooks.advantages(batch, {**per_step, "values": values_BR, "kl": kl})
            if opd_BR is not None:
                advantages_BR = (advantages_BR - opd_BR) * mask_BR
            if c.normalize_advantages:
                advantages_BR = whiten(advantages_BR, mask_BR)
        else:
            advantages_BR, returns_BR = compute_advantages(
                c.loss.advantage_estimator,
                rewards_B,
                mask_BR,
                group_size=batch.group_size,
                kl_BT=kl_BR,
                values_BT=values_BR,
                kl_coef=c.kl_coef,
                gamma=c.gamma,
                lambd=c.lambd,
                normalize_advantages=c.normalize_advantages,
                rewards_normalization=False,
                opd_BT=opd_BR,
            )
        per_step["adv"] = advantages_BR
        critic_t = {"old_values": values_BR, "returns": returns_BR, "mask": mask_BR}
        self.model.train()
        results = []
        for indices in steps:
            metrics = dict(opd_metrics)
            if self.critic is not None:
                critic = self.critic._step(batch, indices, critic_t)
                metrics.update({k if k.startswith("critic/") else f"critic/{k}": v for k, v in critic.items()})
            if self.critic is None or rollout >= c.num_critic_only_steps:
                metrics.update(self._step(batch, indices, per_step))
            if self._agreeing:  # the first step's micro-batches, before it changed the weights
                agreement, self._agreeing = self._agreement(self._agreeing), None
            results.append(metrics)
        self._agreeing = None
        results[-1].update(agreement)  # the rollout's line carries its last step's metrics
        for part in (self, self.critic):
            if part is not None:
                part._gather_weights()
        return results

    def _old_logprobs(self, batch: RolloutBatch, steps: list, rollout_BR: torch.Tensor) -> torch.Tensor:
        """The old policy's log-probs: the engines' under --use-rollout-logprobs, else a forward pass; an MoE model's
        forward in the training's micro-batches, its routing recorded (or the engines', replayed) for the steps."""
        c = self.config
        if self.routing is not None:
            self.routing.clear()
            mbs = [mb for indices in steps for mb in self._micro_batches(batch, indices)]
            if c.use_rollout_routing_replay:
                for mb in mbs:
                    self.routing.recorded[tuple(mb)] = self._engines_routing(batch, mb)
            old_BR = self.full_logprobs(self.model, batch, mbs, "replay" if c.use_rollout_routing_replay else "record")
            return rollout_BR if c.loss.use_rollout_logprobs else old_BR
        return rollout_BR if c.loss.use_rollout_logprobs else self.full_logprobs(self.model, batch)

    def _agreement(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """Train-rollout agreement, as slime and verl report it: the mean and max over every data-parallel rank of
        |trainer log-prob - engine log-prob| on the trained response tokens that have the engine's (`parts`: the
        differences and their masks)."""
        sums = torch.zeros(2, dtype=torch.float64)
        top = torch.zeros(1, dtype=torch.float64)
        for diff, mask in parts:
            masked = diff.detach().double().cpu() * mask.cpu()
            sums += torch.stack([masked.sum(), mask.sum().double()])
            top = torch.maximum(top, masked.max().reshape(1) if masked.numel() else top)
        sums, top = self._all_reduce_dp(sums), self._all_reduce_dp(top, dist.ReduceOp.MAX)
        if not sums[1]:
            return {}
        return {"train_rollout_logprob_abs_diff": float(sums[0] / sums[1]),
                "train_rollout_logprob_abs_diff_max": float(top[0])}  # fmt: skip

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """The reference policy's log-probs (for a KL loss or penalty): its own model's, or with LoRA the policy's
        with the adapters switched off (the base model, not held twice)."""
        c = self.config
        if self.ref_model is not None:
            return self.full_logprobs(self.ref_model, batch)
        if c.lora_rank and (c.loss.use_kl_loss or c.kl_coef):
            from services.trainer import lora

            with lora.disabled(self.model):
                return self.full_logprobs(self.model, batch)
        return None

    def _teacher_logprobs(self, batch: RolloutBatch, mask_BR: torch.Tensor) -> torch.Tensor:
        """The teacher's log-prob of each response token: forwarded here (--opd-type megatron), or as the gateway's
        teacher engines gave them with the samples (sglang), which every trained sample must have."""
        if self.teacher is not None:
            return self.full_logprobs(self.teacher, batch)
        given = batch.teacher_logprobs or [[] for _ in range(len(batch))]
        lengths = batch.response_lengths()
        for i, teacher in enumerate(given):
            if len(teacher) != lengths[i] and mask_BR[i].any():
                raise BatchError(
                    f"sample {batch.sample_ids[i]} has no teacher log-probs, and --use-opd --opd-type sglang trains "
                    "none without: run the gateway with --use-opd --opd-type sglang and teacher engines "
                    "(--opd-teacher-urls or --opd-teacher-hf-checkpoint)"
                )
        rows = [t if len(t) else np.zeros(n, np.float32) for t, n in zip(given, lengths, strict=True)]
        return pad_rows(rows, mask_BR.shape[1])

    def _dp_mean(self, values_B: torch.Tensor) -> float:
        """The mean of a per-sample quantity over every data-parallel rank's samples."""
        total = self._all_reduce_dp(torch.tensor([float(values_B.sum()), float(len(values_B))], dtype=torch.float64))
        return float(total[0] / total[1].clamp(min=1))

    def _step(self, batch: RolloutBatch, indices: list[int], t: dict) -> dict[str, float]:
        c = self.config
        started = time.perf_counter()
        token_level = c.calculate_per_token_loss
        units = float(t["mask"][indices].sum()) if token_level else float(len(indices))
        total = self._all_reduce_dp(torch.tensor(units, dtype=torch.float64))
        self.optimizer.zero_grad(set_to_none=True)
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        mbs = self._micro_batches(batch, indices)
        if not total:  # e.g. every sample's reward failed: its loss is 0, as slime's masked mean clamped at 1
            log.warning(
                "this step has no %s to train on (every sample failed or was aborted)",
                "tokens" if token_level else "samples",
            )
        share = {"token_level": token_level, "total": max(float(total), 1.0)}
        if self.pipelined:
            from services.trainer.pipeline import pipeline_train

            sums = pipeline_train(self, batch, mbs, t, share)
        else:
            sums = {}
            for i, mb in enumerate(mbs):
                replay = self.routing.replay(mb) if self.routing is not None else contextlib.nullcontext()
                with self._reduce_after(last=i == len(mbs) - 1), replay:
                    loss, metrics = self.micro_batch_loss(batch, mb, t, share)
                    if self.routing is not None:
                        self.routing.backward()
                    loss.backward()
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value
        sums.update(self._moe_losses(len(mbs)))
        self._finish_gradients()
        if isinstance(self.optimizer, DistributedAdamW):  # megatron's optimizer clips, and returns the norm
            grad_norm = self.optimizer.step()
        else:
            grad_norm = clip_gradients(
                self.model,
                c.optimizer.clip_grad,
                self.groups.model_parallel or self.groups.tp,
                self.groups.tp_rank,
                self.groups.expert_model_parallel,
            )
            self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        metrics = {k: float(self._all_reduce_dp(torch.as_tensor(v, dtype=torch.float64))) for k, v in sums.items()}
        tokens = self._all_reduce_dp(torch.tensor(float(sum(batch.lengths()[i] for i in indices)), dtype=torch.float64))
        elapsed = time.perf_counter() - started
        return {
            **metrics,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": float(tokens),
            "step_time": elapsed,
            "tokens_per_s": float(tokens) / elapsed,
        }

    def micro_batch_loss(self, batch: RolloutBatch, mb: list[int], t: dict, share: dict):
        if self.hooks["custom_loss_function_path"] is None:
            return self.micro_loss(*self.logprobs(self.model, batch, mb, entropy=True), mb, t, share, batch)
        inputs = self.inputs(batch, mb)
        lengths = [batch.response_lengths()[i] for i in mb]
        take = self._take(t, mb, max(lengths))
        loss, metrics = self.hooks.loss(self.forward(self.model, inputs), inputs, take, lengths, share["token_level"])
        return self._scaled(loss, metrics, t["mask"][mb, : max(lengths)], mb, share)

    def _take(self, t: dict, mb: list[int], width: int) -> dict:
        """Rows `mb` of the rollout's tensors, cut to `width` response tokens, on this rank's device."""
        return {
            k: (v[mb, :width] if v.dim() == 2 else v[mb]).to(self.device, non_blocking=True) if v is not None else None
            for k, v in t.items()
        }

    def micro_loss(self, logprobs_bR, entropy_bR, mb: list[int], t: dict, share: dict, batch: RolloutBatch = None):
        """One micro-batch's loss, scaled by its share of the step's trained tokens (or samples) over all DP ranks,
        and its metrics scaled alike (so that summing gives the step's means)."""
        c = self.config
        take = self._take(t, mb, logprobs_bR.shape[1])
        tis = None
        if batch is not None and c.loss.use_tis:
            lengths, prompts = batch.response_lengths(), batch.prompt_lengths
            tis = self.hooks.tis_function([lengths[i] for i in mb], [prompts[i] for i in mb])
        loss, metrics = policy_loss(
            logprobs_bR,
            take["mask"],
            c.loss,
            old_logprobs_BT=take["old"],
            advantages_BT=take["adv"],
            entropy_BT=entropy_bR,
            ref_logprobs_BT=take["ref"],
            rollout_logprobs_BT=take["rollout"],
            loss_aggregation="token" if share["token_level"] else "sequence",
            tis_function=tis,
        )
        if self._agreeing is not None:  # --use-rollout-logprobs: the first step's log-probs are the old policy's
            self._agreeing.append(((logprobs_bR.detach() - take["rollout"]).abs(), take["engine_mask"]))
        return self._scaled(loss, metrics, t["mask"][mb, : logprobs_bR.shape[1]], mb, share)

    def _scaled(self, loss, metrics: dict, mask_bR, mb: list[int], share: dict):
        """The loss and metrics weighed by the micro-batch's share (`mask_bR`: its loss mask, read where the rollout's
        tensors are, the host). The metrics stay where they are: the step reads them once, at its end, so that no
        micro-batch waits for the device between its forward and its backward."""
        part = (float(mask_bR.sum()) if share["token_level"] else float(len(mb))) / share["total"]
        if self.moe and not self.pipelined:  # the routers' auxiliary losses, added at backward, weigh as this loss
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.full((), part, device=self.device))
        return loss * part, {name: value * part for name, value in metrics.items()}

    @property
    def moe(self) -> bool:
        return bool(getattr(getattr(self.model, "config", None), "num_moe_experts", None))

    def _moe_losses(self, num_micro_batches: int) -> dict[str, float]:
        """The routers' auxiliary losses of this step (megatron's names: load_balancing_loss, z_loss, …, before their
        coefficients), each the mean over layers and micro-batches, scaled to sum to the mean over DP ranks. Megatron
        tracks them per layer as the layers run; the tracker is emptied here for the next step."""
        if not self.moe:
            return {}
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        losses = {}
        for name, tracked in get_moe_layer_wise_logging_tracker().items():
            values = tracked["values"].detach().clone()
            pipeline = parallel_state.get_pipeline_model_parallel_group()
            if dist.get_world_size(pipeline) > 1:  # each stage tracked its own layers
                dist.all_reduce(values, group=pipeline)
            # With tensor parallelism (and so sequence parallelism, which MoE training needs) each rank's loss is
            # its part of the sequence's: summed over the group, as megatron does.
            if tracked.get("reduce_group") is not None and dist.get_world_size(tracked["reduce_group"]) > 1:
                dist.all_reduce(values, group=tracked["reduce_group"])
            dp_size = dist.get_world_size(self.groups.dp) if self.groups.dp is not None else 1
            losses[name] = values.sum() / (len(self._moe_layers()) * num_micro_batches * dp_size)  # read at the end
        clear_aux_losses_tracker()
        return losses

    def _engines_routing(self, batch: RolloutBatch, mb: list[int]) -> list[torch.Tensor]:
        """Each MoE router's `[tokens, top-k]` for micro-batch `mb` from the engines' routing its samples carry, in
        the router's token order (position-major, this rank's part of the sequence under sequence parallelism)."""
        from services.trainer.routing_replay import engines_routing

        config = self.model.config
        sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        return engines_routing(
            [batch.routed_experts[i] if batch.routed_experts else b"" for i in mb],
            [len(batch.tokens[i]) for i in mb],
            [batch.sample_ids[i] for i in mb],
            length=self.inputs(batch, mb)["tokens_BL"].shape[1],
            layers=config.num_layers,
            topk=config.moe_router_topk,
            moe_layers=self._moe_layers(),
            part=(self.groups.tp_rank, config.tensor_model_parallel_size) if sequence_parallel else (0, 1),
        )

    def _moe_layers(self) -> list[int]:
        """The model's MoE layers (megatron's `moe_layer_freq`: every k-th layer, or a 0/1 per layer)."""
        config = self.model.config
        frequency = config.moe_layer_freq
        flags = frequency if isinstance(frequency, list) else [i % frequency == 0 for i in range(config.num_layers)]
        return [layer for layer, is_moe in enumerate(flags) if is_moe]

    @property
    def pipelined(self) -> bool:
        return self.config.parallel.pipeline_model_parallel_size > 1

    def _micro_batches(self, batch: RolloutBatch, indices: list[int]) -> list[list[int]]:
        c = self.config
        lengths = [batch.lengths()[i] for i in indices]
        max_tokens = c.max_tokens_per_gpu if c.use_dynamic_batch_size else None
        if max_tokens is not None and self.budget_chosen:  # a sample longer than the chosen budget trains alone
            max_tokens = max(max_tokens, *lengths)
        return [[indices[j] for j in mb] for mb in micro_batches(lengths, c.micro_batch_size, max_tokens)]

    def _reduce_after(self, last: bool):
        """Before the last micro-batch's backward megatron's DDP only accumulates; with `--overlap-grad-reduce` it
        sends each bucket over the data-parallel ranks as soon as the last backward has filled it."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def _finish_gradients(self) -> None:
        """Completes the step's gradients as megatron's finalize_model_grads does: summed over data-parallel ranks by
        megatron's DDP (an MoE expert's over the ranks holding that expert), then over tensor-parallel ranks for the
        replicated parameters that only see this rank's part of the activations: Qwen3's per-head QK norms (each rank
        holds some heads) and, with sequence parallelism, the layer norms. (Not MLA's latent norms, which
        finalize_model_grads also sums: with the local spec each rank's norm sees the whole latent.) With tied
        embeddings and pipeline stages, the first stage's embedding and the last stage's output layer are one weight:
        their gradients are summed over the two."""
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        if self.groups.embedding is not None:  # both copies of a tied embedding take the same, whole, update
            shared = getattr(self.model, "module", self.model).shared_embedding_or_output_weight()
            dist.all_reduce(shared.main_grad if self.ddp is not None else shared.grad, group=self.groups.embedding)
        tp = self.groups.tp if self.groups.tp is not None and dist.get_world_size(self.groups.tp) > 1 else None
        # Qwen3's and GLM-4.5's QK norms are per head (each TP rank some heads); MLA's see the whole latent.
        per_head = not getattr(getattr(self.model, "config", None), "multi_latent_attention", False)
        for name, param in self.model.named_parameters():
            grad = getattr(param, "main_grad", None) if self.ddp is not None else param.grad
            if grad is None:
                continue
            partial = per_head and ("q_layernorm" in name or "k_layernorm" in name)
            partial = partial or (self.config.parallel.sequence_parallel and getattr(param, "sequence_parallel", False))
            if partial and tp is not None:
                dist.all_reduce(grad, group=tp)
            if self.ddp is not None and not isinstance(self.optimizer, DistributedAdamW) and grad.dtype == param.dtype:
                param.grad = grad  # torch's AdamW reads .grad; MasterAdamW and the clipping read a bf16 one's main_grad

    def _gather_weights(self) -> None:
        """With `--overlap-param-gather` the weights other ranks updated arrive during the next forward; the weight
        sync and checkpoints read them before that, so they are gathered at the end of a rollout."""
        if self.ddp is not None and self.ddp.ddp_config.overlap_param_gather:
            self.ddp.start_param_sync(force_sync=True)

    def _all_reduce_dp(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.groups.dp is not None and dist.get_world_size(self.groups.dp) > 1:
            value = value.to(self.device)
            dist.all_reduce(value, op=op, group=self.groups.dp)
        return value.cpu()


def from_hidden(config: TrainerConfig, model) -> bool:
    """Whether log-probs come from the hidden states (--log-probs-from-hidden); unset: on GPUs, for a Megatron model
    (its output layer), unless a LoRA adapter sits on the output layer."""
    if config.log_probs_from_hidden is not None:
        return config.log_probs_from_hidden
    adapted = config.lora_rank and "lm_head" in config.target_modules
    return torch.cuda.is_available() and hasattr(getattr(model, "module", model), "output_layer") and not adapted
