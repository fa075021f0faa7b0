"""GroupedExperts (services/trainer/grouped_experts.py), the experts of every MoE model here (no Transformer Engine,
no grouped_gemm), against megatron's SequentialMLP on a Qwen3-MoE-shaped model: the same log-probs, gradients and
optimizer step, to float32's rounding and within bf16's. Expert parallelism runs it too: tests/trainer/test_models.py
(EP=2 over two processes equals HF) and tests/trainer/test_parallel_training.py (EP=2 trains as one rank)."""

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from services.train.tiny_checkpoint import write_tiny_model
from services.trainer import data_parallel, grouped_experts, models
from services.trainer.config import TrainerConfig
from services.trainer.grouped_experts import GroupedExperts


@pytest.fixture
def megatron_tp1():
    from services.trainer.parallel import destroy_parallel, init_parallel

    yield init_parallel(tp_size=1)
    destroy_parallel()


def one_step(path, grouped: bool, dtype: torch.dtype, monkeypatch, moved: bool = False, ddp: dict | None = None):
    """Log-probs, gradients and the weights after one AdamW step, with the grouped experts or megatron's own; `moved`:
    one expert's weight moved out of the stacked tensor, so that the forward stacks copies; `ddp`: inside megatron's
    DDP with these trainer settings, its float32 `main_grad`s the gradients."""
    monkeypatch.setattr(models, "HAVE_GROUPED_GEMM", not grouped)  # where grouped_gemm is, megatron's module stays
    calls = []
    monkeypatch.setattr(grouped_experts, "grouped_mm", lambda *a, **k: calls.append(1) or torch._grouped_mm(*a, **k))
    model, config = models.load_gpt_model(path, dtype=dtype)
    experts = [m for m in model.modules() if isinstance(m, SequentialMLP)]
    assert experts and all(isinstance(m, GroupedExperts) == grouped for m in experts)
    for layer in experts if grouped else []:
        weight = layer.local_experts[3].linear_fc2.weight
        if moved:
            weight.data = weight.data.clone()
        stacked = type(layer.weights("linear_fc2").grad_fn).__name__
        assert stacked == ("StackBackward0" if moved else "StackedBackward"), stacked  # a copy only when moved
    wrapped = model if ddp is None else data_parallel.wrap(model, TrainerConfig(**ddp))
    ids = torch.randint(0, config.shape.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = wrapped(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    logprobs = models.token_logprobs(logits[:, :-1], ids[:, 1:], config.shape.vocab_size)
    logprobs.mean().backward()
    if ddp is not None:
        wrapped.finish_grad_sync()
        for param in model.parameters():
            param.grad = param.main_grad.to(param.dtype)
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert len(calls) == (2 * len(experts) if grouped else 0)  # two grouped GEMMs a layer, none of megatron's
    for layer in experts if grouped and not moved else []:  # the step moved the weights inside the stacked tensors
        assert all(
            torch.equal(layer.stacked["linear_fc1"][i], e.linear_fc1.weight) for i, e in enumerate(layer.local_experts)
        )
    return logprobs.detach().float(), grads, {name: p.detach().float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("moved", [False, True], ids=["views", "copies"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_experts_train_as_megatrons_sequential_mlp(dtype, tolerance, moved, megatron_tp1, monkeypatch,
                                                           tmp_path):  # fmt: skip
    path = write_tiny_model(tmp_path / "model", arch="qwen3_moe")
    sequential, grouped = (one_step(path, flag, dtype, monkeypatch, moved) for flag in (False, True))
    torch.testing.assert_close(grouped[0], sequential[0], atol=tolerance, rtol=0)
    assert any(".local_experts.7." in name for name in grouped[1])  # every expert has its parameters, by its name
    for before, after in zip(sequential[1:], grouped[1:], strict=True):
        assert before.keys() == after.keys()
        for name in before:
            torch.testing.assert_close(after[name], before[name], atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("overlap", [False, True], ids=["reduce-after", "overlap-grad-reduce"])
def test_inside_megatrons_ddp_the_grouped_experts_gradients_are_sequential_mlps(overlap, megatron_tp1, monkeypatch,
                                                                                tmp_path):  # fmt: skip
    """bf16 in megatron's DDP, as the trainer runs it: the gradients add up in float32 `main_grad`s, bucket by bucket
    during the backward with --overlap-grad-reduce."""
    path = write_tiny_model(tmp_path / "model", arch="qwen3_moe")
    ddp = {"rollout_batch_size": 1, "n_samples_per_prompt": 1, "global_batch_size": 1, "micro_batch_size": 1,
           "bf16": True, "overlap_grad_reduce": overlap}  # fmt: skip
    sequential, grouped = (one_step(path, flag, torch.bfloat16, monkeypatch, ddp=ddp) for flag in (False, True))
    torch.testing.assert_close(grouped[0], sequential[0], atol=3e-2, rtol=0)
    for before, after in zip(sequential[1:], grouped[1:], strict=True):
        for name in before:
            torch.testing.assert_close(after[name], before[name], atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_compile_model_compiles_what_torch_compile_can_trace(arch, megatron_tp1, tmp_path):
    """--compile-model: a dense layer whole; an MoE layer's attention (its token dispatcher reads counts on the host);
    multi-latent attention with its core attention eager (inductor fails on it). Each trains a step compiled."""
    from services.trainer.actor import Actor

    model, config = models.load_gpt_model(write_tiny_model(tmp_path / "model", arch=arch), dtype=torch.float32)
    Actor._compile_layers(model)
    ids = torch.randint(0, config.shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(16).expand_as(ids), attention_mask=None).float().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    moe = [hasattr(layer.mlp, "router") for layer in model.decoder.layers]
    assert any(moe) == (arch != "qwen3")  # deepseek_v3's first layer is dense
    for layer, routed in zip(model.decoder.layers, moe, strict=True):
        assert (layer._compiled_call_impl is not None) == (not routed)
        assert (layer.self_attention._compiled_call_impl is not None) == routed
