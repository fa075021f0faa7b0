"""The token budget of a micro-batch chosen from the free memory (services/trainer/token_budget.py): its estimate
against what was measured on an H200, the arithmetic, and when it applies."""

import os
import types
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.processes import free_port
from services.trainer import token_budget
from services.trainer.config import TrainerConfig
from services.trainer.hf_names import ModelShape

QWEN3_0_6B = ModelShape(num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8, head_dim=128,
                        ffn_hidden_size=3072, vocab_size=151936, padded_vocab_size=151936, tie_word_embeddings=True,
                        qkv_bias=False, qk_layernorm=True)  # fmt: skip
GIB = 2**30


def _gpt(shape=QWEN3_0_6B):
    return types.SimpleNamespace(shape=shape, transformer=types.SimpleNamespace(moe_router_topk=None))


def test_the_estimate_is_a_little_above_what_an_h200_measured():
    """bench/trainer_step.py, Qwen3-0.6B's shape, 16,384 tokens, on an H200 on 2026-12-02
    (docs/benchmarks/trainer-h200-2026-12-02.md): the full logits cost 54.2 - 38.2 GiB more than the streamed ones,
    and keeping every layer's activations 38.2 - 12.3 GiB more than recomputing them. The estimate's differences
    are 1.0-1.3 x those."""
    per = {(recompute, hidden): token_budget.bytes_per_token(_gpt(), 1, recompute, hidden, 8192)
           for recompute in (False, True) for hidden in (False, True)}  # fmt: skip
    logits = (per[False, False] - per[False, True]) * 16384 / GIB
    layers = (per[False, True] - per[True, True]) * 16384 / GIB
    assert 1.0 <= logits / (54.2 - 38.2) <= 1.3, logits
    assert 1.0 <= layers / (38.2 - 12.3) <= 1.3, layers


def test_the_budget_is_what_fits_after_the_optimizer_state_and_a_reserve():
    per_token = 100 * 1024
    tokens = token_budget.choose(free_bytes=40 * GIB, pending_bytes=5 * GIB, per_token=per_token)
    assert tokens % 256 == 0
    assert (tokens + 256) * per_token > 0.9 * 40 * GIB - 6 * GIB >= tokens * per_token
    assert token_budget.choose(free_bytes=GIB, pending_bytes=GIB, per_token=per_token) == 256


def _config(**settings):
    return TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, **settings)


def test_on_the_cpu_micro_batches_keep_their_size_unless_asked(monkeypatch):
    import torch

    model = torch.nn.Linear(4, 4)
    config = _config()
    assert config.use_dynamic_batch_size is None
    assert not token_budget.resolve(config, _gpt(), model, True, 8192)
    assert config.use_dynamic_batch_size is False and config.max_tokens_per_gpu is None
    given = _config(use_dynamic_batch_size=True, max_tokens_per_gpu=4096)
    assert not token_budget.resolve(given, _gpt(), model, True, 8192) and given.max_tokens_per_gpu == 4096
    asked = _config(use_dynamic_batch_size=True)
    assert token_budget.resolve(asked, _gpt(), model, True, 8192)
    assert asked.max_tokens_per_gpu >= 256 and asked.max_tokens_per_gpu % 256 == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_on_a_gpu_micro_batches_go_by_tokens_with_one_pipeline_stage(monkeypatch, pipelined):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    config = _config(parallel={"pipeline_model_parallel_size": 2}) if pipelined else _config()
    chosen = token_budget.resolve(config, _gpt(), torch.nn.Linear(4, 4), True, 8192)
    assert config.use_dynamic_batch_size is (not pipelined) and chosen is (not pipelined)
    if not pipelined:
        per_token = token_budget.bytes_per_token(_gpt(), 1, False, True, 8192)
        assert config.max_tokens_per_gpu == token_budget.choose(100 * GIB, 8 * 20, per_token)
        resident = _config().model_copy(update={"colocate": True, "offload_rollout": False})  # the rest unchecked
        token_budget.resolve(resident, _gpt(), torch.nn.Linear(4, 4), True, 8192)
        assert resident.max_tokens_per_gpu < config.max_tokens_per_gpu / 4  # the engines keep all but 15 %


def test_a_micro_batch_size_the_user_gave_keeps_micro_batches_of_that_size_on_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, micro_batch_size=2)
    assert not token_budget.resolve(config, _gpt(), torch.nn.Linear(4, 4), True, 8192)
    assert config.use_dynamic_batch_size is False and config.max_tokens_per_gpu is None


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    Path(out, f"rank{rank}").write_text(str(token_budget._least_over_ranks([4096, 1536][rank])))
    dist.destroy_process_group()


def test_every_rank_takes_the_smallest_budget_any_rank_chose(tmp_path):
    """Each GPU has its own free memory, and the ranks of a model-parallel group must cut a step alike."""
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ["1536", "1536"]
