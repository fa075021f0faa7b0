"""`--use-routing-replay`: the training forward of an MoE model routes each token to the experts the old policy chose
for it (megatron-core's RouterReplay), so that an update changes the experts' weights but not which experts answer:
the importance ratio compares the same computation, as slime's option does.

The old policy's log-probs are computed micro-batch by micro-batch in the training's own micro-batches (same samples,
same padding), recording each router's top-k; each training micro-batch then replays its recording in the forward
and, where activations are recomputed, in the backward's second forward."""

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


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
