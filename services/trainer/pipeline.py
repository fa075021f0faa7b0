"""Pipeline-parallel passes through Megatron's schedule (1F1B): the forward-only pass for old and reference
log-probs, and the training pass whose loss is computed on the last stage with the actor's own loss code.

Megatron's schedules send activations of one fixed shape `[seq, micro_batch, hidden]`, so every micro-batch of a
step is padded to the step's longest sample and holds exactly `--micro-batch-size` samples.
"""

import functools

import torch
import torch.distributed as dist

from services.trainer.data import RolloutBatch


def _schedule(actor, model, batch: RolloutBatch, mbs: list[list[int]], loss_of, forward_only: bool) -> list:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    length = max(max(batch.lengths()[i] for i in mb) for mb in mbs)
    inputs = iter([actor.inputs(batch, mb, length) for mb in mbs])

    def forward_step(data_iterator, model):
        step_inputs = next(data_iterator)
        return actor.forward(model, step_inputs), functools.partial(loss_of, step_inputs, len(mbs))

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=inputs,
        model=[model],
        num_microbatches=len(mbs),
        seq_length=length,
        micro_batch_size=len(mbs[0]),
        forward_only=forward_only,
    )
    return outputs if parallel_state.is_pipeline_last_stage() else []


def pipeline_logprobs(actor, model, batch: RolloutBatch, mbs: list[list[int]]) -> list[torch.Tensor]:
    """Each micro-batch's `[b, R]` log-probs on the last stage; zeros elsewhere."""

    def loss_of(inputs, num_microbatches, logits):
        logprobs, _ = actor.response_logprobs(logits, inputs)
        return logits.new_zeros(()), {"logprobs": logprobs.detach()}

    outputs = _schedule(actor, model, batch, mbs, loss_of, forward_only=True)
    if outputs:
        return [out["logprobs"] for out in outputs]
    return [torch.zeros(len(mb), max(batch.response_lengths()[i] for i in mb)) for mb in mbs]


def pipeline_train(actor, batch: RolloutBatch, mbs: list[list[int]], t: dict, share: dict) -> dict[str, float]:
    """Forward and backward of every micro-batch; returns the step's metric sums, the same on every stage."""
    from megatron.core import parallel_state

    order = iter(mbs)

    def loss_of(inputs, num_microbatches, logits):
        mb = next(order)
        loss, metrics = actor.micro_loss(*actor.response_logprobs(logits, inputs), mb, t, share, batch)
        return loss * num_microbatches, metrics  # the schedule divides by the number of micro-batches

    outputs = _schedule(actor, actor.model, batch, mbs, loss_of, forward_only=False)
    sums: dict[str, float] = {}
    for metrics in outputs:
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    holder = [sums]
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(holder, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return holder[0]
