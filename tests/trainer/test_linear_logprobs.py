"""Log-probs and entropy streamed over the vocabulary from the hidden states and the output layer's weight
(services/trainer/linear_logprobs.py) equal the full computation, values and gradients, in float32 to 1e-5: with a
chunk that does not divide the vocabulary, padding columns, bf16, and the vocabulary split over two CPU processes."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.processes import free_port
from services.trainer.linear_logprobs import linear_logprobs_and_entropy


def full(hidden, weight, tokens, num_valid=None):
    """The reference: every logit in float32, log-softmax, gather, entropy."""
    logits = (hidden @ weight.T).float()
    if num_valid is not None:
        logits = logits[:, :num_valid]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, tokens[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def problem(seed: int = 0, tokens: int = 13, vocab: int = 50, dim: int = 8, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, dim, generator=generator) * 2).to(dtype)
    weight = torch.randn(vocab, dim, generator=generator).to(dtype)
    return hidden, weight, torch.randint(0, vocab, (tokens,), generator=generator)


def grads(function, hidden, weight, tokens, **kwargs):
    hidden, weight = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    logp, entropy = function(hidden, weight, tokens, **kwargs)
    weights = torch.linspace(-1, 2, len(tokens))
    (logp * weights + entropy * weights.flip(0)).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [7, 50, 4096])
def test_values_and_gradients_equal_the_full_computation(chunk_size):
    hidden, weight, tokens = problem()
    ours = grads(linear_logprobs_and_entropy, hidden, weight, tokens, chunk_size=chunk_size)
    for got, expected in zip(ours, grads(full, hidden, weight, tokens), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_padding_columns_take_no_probability():
    hidden, weight, tokens = problem(seed=1)
    tokens = tokens.clamp(max=39)
    ours = grads(linear_logprobs_and_entropy, hidden, weight, tokens, chunk_size=16, num_valid=40)
    reference = grads(full, hidden, weight, tokens, num_valid=40)
    for got, expected in zip(ours, reference, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bf16_weights_give_float32_log_probs_close_to_the_bf16_logits_path():
    hidden, weight, tokens = problem(seed=2, dtype=torch.bfloat16)
    logp, entropy, hidden_grad, weight_grad = grads(linear_logprobs_and_entropy, hidden, weight, tokens, chunk_size=16)
    expected = grads(full, hidden, weight, tokens)
    assert logp.dtype == entropy.dtype == torch.float32 and hidden_grad.dtype == weight_grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp, expected[0], atol=1e-5, rtol=1e-5)  # the same bf16 logits, upcast
    torch.testing.assert_close(entropy, expected[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden_grad.float(), expected[2].float(), atol=5e-2, rtol=2e-2)


def test_bad_shapes_name_the_argument():
    hidden, weight, tokens = problem()
    with pytest.raises(ValueError, match="tokens_T"):
        linear_logprobs_and_entropy(hidden, weight, tokens[:-1])
    with pytest.raises(ValueError, match="weight_VH"):
        linear_logprobs_and_entropy(hidden, weight[:, :-1], tokens)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs_and_entropy(hidden, weight, tokens, chunk_size=0)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hidden, weight, tokens = problem(seed=3, vocab=52)  # 26 columns a rank, the last two of them padding
    shard = weight[26 * rank : 26 * (rank + 1)]
    got = grads(linear_logprobs_and_entropy, hidden, shard, tokens.clamp(max=49), chunk_size=10,
                vocab_start=26 * rank, num_valid=50, group=dist.group.WORLD)  # fmt: skip
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_the_vocabulary_split_over_two_processes_equals_one(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    hidden, weight, tokens = problem(seed=3, vocab=52)
    logp, entropy, hidden_grad, weight_grad = grads(full, hidden, weight, tokens.clamp(max=49), num_valid=50)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got[0], logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[3], weight_grad[26 * rank : 26 * (rank + 1)], atol=1e-5, rtol=1e-5)
    # each rank's part of the hidden states' gradient, summed as Megatron's copy into the TP region sums it
    torch.testing.assert_close(ranks[0][2] + ranks[1][2], hidden_grad, atol=1e-5, rtol=1e-5)
