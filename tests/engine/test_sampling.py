"""The engine's token choice: every row of a decode step drawn in one pass, each with its own sampling params."""

import torch

from services.engine.sampling import SamplingParams, choose_batch, truncate


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
