"""The engine's token choice: every row of a decode step drawn in one pass, each with its own sampling params."""

import pytest
import torch

from services.engine.compiled import compile_pick
from services.engine.sampling import SamplingParams, choose_batch, pick, pick_temperature, plain, truncate


def test_each_row_is_cut_by_its_own_top_k_top_p_and_min_p_in_one_pass():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 5)
    params = [
        SamplingParams(),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.6),  # 0.4 + 0.3 reach 0.6: the rest is out
        SamplingParams(min_p=0.6),  # below 0.6 * 0.4 = 0.24 is out
        SamplingParams(top_k=3, top_p=0.5),
    ]
    cut = truncate(probs, params)
    assert (cut > 0).tolist() == [[True] * 4] + [[True, True, False, False]] * 4
    assert torch.equal(cut[cut > 0], probs[cut > 0])
    for row, p in enumerate(params):  # a row alone is cut as it is among others
        assert torch.equal(truncate(probs[row : row + 1], [p])[0], cut[row])


def test_a_batch_mixes_greedy_sampled_and_seeded_rows_with_sglangs_log_probs():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=1),  # top_k 1 is greedy too
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.0, sampling_seed=7),
        SamplingParams(temperature=2.0, min_p=0.5),
    ]
    seeded = torch.Generator().manual_seed(7)
    generators = [None, None, None, None, seeded, None]
    picked = list(zip(*(t.tolist() for t in choose_batch(logits.clone(), params, generators)), strict=True))
    assert [token for token, _ in picked[:2]] == logits[:2].argmax(-1).tolist()
    for row, ((token, logprob), p) in enumerate(zip(picked, params, strict=True)):
        temperature = 1.0 if p.greedy else p.temperature
        expected = torch.log_softmax(logits[row] / temperature, -1)[token]
        assert abs(logprob - float(expected)) < 1e-5  # before truncation, as SGLang reports it
    assert picked[2][0] in torch.topk(logits[2], 3).indices.tolist()
    for _ in range(20):  # a seeded row draws the same token again from a generator seeded alike
        generators[4] = torch.Generator().manual_seed(7)
        again = list(zip(*(t.tolist() for t in choose_batch(logits.clone(), params, generators)), strict=True))
        assert again[4][0] == picked[4][0]
        probs = torch.softmax(logits[3], -1)
        assert probs[again[3][0]] >= probs.max() - 1e-6 or probs.max() < 0.3  # top_p 0.3 keeps the top token alone


@pytest.mark.parametrize("compiled", [False, True], ids=["as-written", "compiled"])
def test_pick_draws_plain_rows_as_choose_batch_does(compiled):
    """The draw a decode step makes itself for plain sequences (inside its CUDA graph on a GPU): greedy rows take the
    argmax, sampled rows follow softmax(logits / temperature), log-probs are SGLang's, whether compiled or not."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    logits[:2] = torch.randn(2, 4) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1)]
    params += [SamplingParams(temperature=0.5)] * (len(logits) - 2)
    assert all(plain(p, None) for p in params) and not plain(SamplingParams(top_p=0.9), None)
    draw = compile_pick(pick) if compiled else pick
    tokens, logprobs = draw(logits, torch.tensor([pick_temperature(p) for p in params]))
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()
    temperatures = torch.tensor([1.0, 1.0] + [0.5] * (len(logits) - 2))[:, None]
    expected = torch.log_softmax(logits / temperatures, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)
    frequencies = torch.bincount(tokens[2:], minlength=4) / (len(logits) - 2)
    torch.testing.assert_close(frequencies, torch.softmax(logits[2] / 0.5, -1), atol=0.03, rtol=0)
    if not compiled:  # as written, the same random numbers as the engine's own draw
        torch.manual_seed(1)
        alone = choose_batch(logits[2:], params[2:], [None] * (len(logits) - 2))
        torch.manual_seed(1)
        assert torch.equal(pick(logits[2:], torch.full((len(logits) - 2,), 0.5))[0], alone[0])
