"""The engines' routing (SGLang's routed_experts) laid out as megatron's routers see a micro-batch's tokens."""

import numpy as np
import pytest
import torch

from services.trainer.data import BatchError
from services.trainer.routing_replay import engines_routing


def _routed(rows: int, layers: int = 3, topk: int = 2, offset: int = 0) -> bytes:
    ids = (np.arange(rows * layers * topk, dtype=np.int32) + offset).reshape(rows, layers, topk) % 8
    return ids.tobytes()


def test_position_major_tokens_with_distinct_experts_where_the_engine_gave_none():
    """Two samples of 4 and 3 tokens padded to 5 positions; the engine routed 3 and 2 tokens (all but the last). MoE
    layers 1 and 2 of 3; the routers see token (position p, sample b) at row p * 2 + b."""
    routed = [_routed(3), _routed(2, offset=4)]
    per_layer = engines_routing(routed, [4, 3], ["a/0", "a/1"], length=5, layers=3, topk=2, moe_layers=[1, 2])
    assert len(per_layer) == 2 and per_layer[0].shape == (10, 2) and per_layer[0].dtype == torch.int64
    given = [np.frombuffer(r, np.int32).reshape(-1, 3, 2) for r in routed]
    for position in range(5):
        for b, ids in enumerate(given):
            row = per_layer[1][position * 2 + b].tolist()
            assert row == (ids[position, 2].tolist() if position < len(ids) else [0, 1])


def test_sequence_parallel_ranks_take_their_part_of_the_positions():
    whole = engines_routing([_routed(5)], [6], ["a/0"], length=6, layers=3, topk=2, moe_layers=[1])[0]
    halves = [engines_routing([_routed(5)], [6], ["a/0"], length=6, layers=3, topk=2, moe_layers=[1],
                              part=(rank, 2))[0] for rank in range(2)]  # fmt: skip
    assert torch.equal(torch.cat(halves), whole) and halves[0].shape == (3, 2)


@pytest.mark.parametrize("routed", [b"", _routed(4)])
def test_a_sample_without_the_engines_routing_names_the_fix(routed):
    with pytest.raises(BatchError, match=r"sample g/3: routed_experts .* \(--enable-return-routed-experts"):
        engines_routing([routed], [4], ["g/3"], length=4, layers=3, topk=2, moe_layers=[1])
