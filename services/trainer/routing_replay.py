"""Routing replay for MoE models (megatron-core's RouterReplay), slime's two options: `--use-routing-replay`, the
training forward routes each token to the experts the old policy chose for it, and `--use-rollout-routing-replay`,
every forward of the trainer routes it to the experts the engine chose when it generated the sample. An update then
changes the experts' weights but not which experts answer: the importance ratio compares the same computation.

The old policy's log-probs are computed micro-batch by micro-batch in the training's own micro-batches (same samples,
same padding), recording each router's top-k (or replaying the engines'); each training micro-batch then replays
its routing in the forward and, where activations are recomputed, in the backward's second forward."""

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from services.trainer.data import BatchError


class RoutingReplay:
    def __init__(self) -> None:
        self.recorded: dict[tuple[int, ...], list[torch.Tensor]] = {}

    @contextlib.contextmanager
    def record(self, micro_batch: list[int]) -> Iterator[None]:
        """Every router records its choice for this micro-batch's tokens during the block (one forward)."""
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            self.recorded[tuple(micro_batch)] = [indices.clone() for indices in RouterReplay.get_recorded_data()]
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()

    @contextlib.contextmanager
    def replay(self, micro_batch: list[int]) -> Iterator[None]:
        """The block's forward (and a recompute in its backward) routes as recorded for this micro-batch."""
        RouterReplay.set_replay_data(self.recorded[tuple(micro_batch)])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()

    @staticmethod
    def backward() -> None:
        """From here on (the backward pass), a recomputed forward pops the same recording."""
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def clear(self) -> None:
        self.recorded.clear()


def engines_routing(
    routed: list[bytes],
    lengths: list[int],
    sample_ids: list[str],
    length: int,
    layers: int,
    topk: int,
    moe_layers: list[int],
    part: tuple[int, int] = (0, 1),
) -> list[torch.Tensor]:
    """Each MoE layer's `[tokens, topk]` expert ids for a micro-batch of samples padded to `length` positions, in the
    order its router sees them (position-major; `part` (rank, size): this rank's part of the sequence). `routed` is
    SGLang's `routed_experts` per sample: int32 `[rows, layers, topk]`, row i the experts chosen for token i as an
    input, all tokens but the last. Positions without a row (the last token, tokens a generate function appended after
    its last call, padding) get k distinct experts: they precede nothing that is trained, and the dispatcher needs
    distinct ones."""
    columns = []
    for raw, tokens, sample_id in zip(routed, lengths, sample_ids, strict=True):
        ids = np.frombuffer(raw, dtype=np.int32)
        rows = ids.size // (layers * topk)
        if not raw or ids.size % (layers * topk) or rows >= tokens:
            raise BatchError(
                f"sample {sample_id}: routed_experts holds {ids.size} expert ids, not [rows < {tokens} "
                f"tokens, {layers} layers, top-{topk}]; the engines must return them "
                "(--enable-return-routed-experts, which --use-rollout-routing-replay passes)"
            )
        column = torch.arange(topk).repeat(length, layers, 1)
        column[:rows] = torch.from_numpy(ids.reshape(rows, layers, topk).astype(np.int64))
        columns.append(column)
    tokens_first = torch.stack(columns, dim=1).reshape(-1, layers, topk)  # [length x samples, layers, top-k]
    rank, size = part
    mine = tokens_first.chunk(size)[rank]
    return [mine[:, layer].contiguous() for layer in moe_layers]
