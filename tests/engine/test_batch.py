"""The engine's continuous batching (services/engine/batch.py): sequences that join, grow past the cache's size and
leave mid-batch each get, at every decode step, the logits the model gives that sequence alone; on a GPU also when
the step replays from CUDA graphs (services/engine/graphs.py)."""

import copy

import pytest
import torch

from services.engine.batch import Batcher, Sequence
from services.engine.graphs import DecodeGraphs
from services.engine.sampling import SamplingParams

MODES = [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cpu", True, id="cpu-row-buckets"),  # the graphs' shapes, run eagerly: no CUDA here
    pytest.param("cuda", True, id="cuda-graphs", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("device", "graphs"), MODES)
def test_every_row_of_every_step_equals_its_sequence_alone(hf_model, device, graphs):
    model = copy.deepcopy(hf_model[0]).to(device)
    graphs = DecodeGraphs(torch.device(device), max_rows=8) if graphs else None
    batcher = Batcher(model, torch.device(device), graphs=graphs)
    prompts = [list(range(5, 5 + length)) for length in (3, 20, 7, 12, 5)]
    sequences = [Sequence(rid=str(i), prompt_ids=p, params=SamplingParams()) for i, p in enumerate(prompts)]

    def check(rows: list[Sequence], logits: torch.Tensor) -> None:
        for seq, row in zip(rows, logits, strict=True):
            alone = model(input_ids=torch.tensor([seq.prompt_ids + seq.output_ids], device=device)).logits[0, -1]
            torch.testing.assert_close(row, alone, atol=2e-4, rtol=1e-4)
            seq.output_ids.append(int(row.argmax()))

    check(sequences[:3], torch.stack([logits[-1] for logits in batcher.prefill(sequences[:3])]))
    with torch.no_grad():
        for step in range(24):
            if step == 2:  # two more join a running batch
                check(sequences[3:], torch.stack([logits[-1] for logits in batcher.prefill(sequences[3:])]))
            if step == 5:  # a row in the middle leaves: the last row takes its place
                batcher.drop([sequences[1]])
                assert batcher.rows == [sequences[0], sequences[4], sequences[2], sequences[3]]
            check(list(batcher.rows), batcher.step())
    assert batcher.cache.width == 64  # grew from 32 while rows ran (the longest is at 12 + 24 + 1 positions)
    if device == "cuda":
        assert graphs.captures >= 2 and not graphs.failed  # the rows' buckets 4 and 8
    batcher.drop(list(batcher.rows))
    assert batcher.rows == []
