"""Parallel training under torchrun over gloo, against the same run in one process: TP=2 (vocab-parallel log-probs,
TP-aware gradient clipping) and DP=2 (each rank its part of the batch, gradients summed) end two steps with the
parameters of TP=1, DP=1. AdamW's epsilon is raised (1e-3) so that gradients that are zero up to rounding, which
differ in sign between the runs, do not become full-size updates: what is compared is the training, not the noise."""

import json

import pytest
import torch

from services.train.tiny_checkpoint import write_tiny_model
from services.trainer.hf_names import merge_tp_shards
from services.trainer.parallel import apply_cpu_threads
from tests.trainer.conftest import trainer_args, weights

STEPS = ["--num-rollout", "2", "--adam-eps", "1e-3"]


def test_a_gpu_rank_runs_its_cpu_operators_on_one_thread_unless_omp_num_threads_says_otherwise(monkeypatch):
    """As torchrun does for each rank when it starts several: a lone rank no longer wakes every core's thread for each
    small operator on the host while the GPU waits (init_parallel applies it on GPUs)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        apply_cpu_threads()
        assert torch.get_num_threads() == 2  # the operator's setting wins
        monkeypatch.delenv("OMP_NUM_THREADS")
        apply_cpu_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def torchrun(service_process):
    def run(args: list[str]) -> None:
        proc = service_process(*args, nproc=2)
        assert proc.wait(timeout_s=300) == 0, proc.log[-4000:]

    return run


@pytest.fixture
def single(filled_buffer, service_process, model, tmp_path):
    proc = service_process(*trainer_args(model, filled_buffer("one"), tmp_path / "one", *STEPS))
    assert proc.wait(timeout_s=240) == 0, proc.log
    return weights(tmp_path / "one", 2)


def test_tp2_training_equals_tp1(single, filled_buffer, model, tmp_path, torchrun):
    args = trainer_args(model, filled_buffer("tp"), tmp_path / "tp", *STEPS, "--tensor-model-parallel-size", "2")
    torchrun(args)
    shards = [torch.load(tmp_path / "tp" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            merged = merge_tp_shards(name, [shard[name] for shard in shards])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_tp2_with_sequence_parallel_and_log_probs_from_hidden_equals_tp1(single, filled_buffer, model, tmp_path,
                                                                        torchrun):  # fmt: skip
    """--log-probs-from-hidden over two TP ranks with the sequence split between them: the hidden states gathered
    as the output layer gathers them, the vocabulary's normaliser reduced over the ranks; the same training as one
    rank's logits path."""
    args = trainer_args(model, filled_buffer("hidden"), tmp_path / "hidden", *STEPS, "--tensor-model-parallel-size",
                        "2", "--sequence-parallel", "--log-probs-from-hidden")  # fmt: skip
    torchrun(args)
    shards = [torch.load(tmp_path / "hidden" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            merged = merge_tp_shards(name, [shard[name] for shard in shards])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_dp2_training_equals_dp1(single, filled_buffer, model, tmp_path, torchrun):
    torchrun(trainer_args(model, filled_buffer("dp"), tmp_path / "dp", *STEPS))
    for name, expected in weights(tmp_path / "dp", 2).items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(expected, single[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pp2_training_equals_pp1(single, filled_buffer, model, tmp_path, torchrun):
    """Two pipeline stages (one layer each) through Megatron's 1F1B schedule over gloo."""
    _assert_pp2_equals(single, model, filled_buffer("pp"), tmp_path, torchrun)


def test_pp2_with_tied_embeddings_equals_pp1(filled_buffer, service_process, tmp_path, torchrun):
    """Qwen3 0.6B-4B and Llama 3.2 tie the output layer to the embedding: with two stages the first holds the
    embedding and the last its copy as the output layer; both take the sum of their gradients and stay one weight,
    the one-process run's."""
    tied = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    proc = service_process(*trainer_args(tied, filled_buffer("tied"), tmp_path / "one", *STEPS))
    assert proc.wait(timeout_s=240) == 0, proc.log
    single = weights(tmp_path / "one", 2)
    last = _assert_pp2_equals(single, tied, filled_buffer("tied-pp"), tmp_path, torchrun)
    torch.testing.assert_close(last["output_layer.weight"], single["embedding.word_embeddings.weight"])


def _assert_pp2_equals(single: dict, model, buffer: str, tmp_path, torchrun) -> dict:
    """Trains `model` on two stages and checks each weight against the one-process run's; returns the last stage's."""
    args = trainer_args(model, buffer, tmp_path / "pp", *STEPS, "--pipeline-model-parallel-size", "2",
                        "--micro-batch-size", "2")  # fmt: skip
    torchrun(args)
    stages = [torch.load(tmp_path / "pp" / "iter_0000002" / f"mp_rank_00_{r:03d}.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    merged = {}
    for stage, state in enumerate(stages):  # local layer 0 of stage s is global layer s (one layer per stage)
        for name, value in state.items():
            merged[name.replace("decoder.layers.0.", f"decoder.layers.{stage}.")] = value
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=1e-4, msg=name)
    return stages[-1]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from services.train.tiny_checkpoint import write_tiny_model

    root = tmp_path_factory.mktemp("moe-models")
    return {arch: write_tiny_model(root / arch, arch=arch) for arch in ("qwen3_moe", "glm4_moe", "deepseek_v3")}


def _experts_merged(folder, shards: list[str]) -> dict:
    """One state dict from expert-parallel ranks' shards: rank e's local expert j is global expert e * local + j."""
    merged = {}
    for ep_rank, shard in enumerate(shards):
        state = torch.load(folder / "iter_0000002" / shard, weights_only=False)["model"]
        local = 1 + max(int(n.split("local_experts.")[1].split(".")[0]) for n in state if "local_experts." in n)
        for name, value in state.items():
            if "local_experts." in name:
                head, rest = name.split("local_experts.")
                expert, tail = rest.split(".", 1)
                name = f"{head}local_experts.{ep_rank * local + int(expert)}.{tail}"
            merged[name] = value
    return merged


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_moe_training_with_experts_or_tensors_split_equals_one_rank(arch, layout, moe_models, filled_buffer,
                                                                      service_process, torchrun, tmp_path):  # fmt: skip
    """Each MoE family for two steps: EP=2 (each rank four of the eight experts, tokens sent to them all-to-all;
    DP=2) and TP=2 (experts split over the TP ranks, sequence-parallel as megatron's MoE needs) end with the weights
    of one rank, and Qwen3-MoE reports the same load-balancing loss (the others' routers have none)."""
    moe_model = moe_models[arch]

    def run(name: str, *extra: str) -> list[dict]:
        args = trainer_args(moe_model, filled_buffer(name), tmp_path / name, *STEPS, *extra,
                            "--steps-file", str(tmp_path / f"steps-{name}.jsonl"))  # fmt: skip
        if extra:
            torchrun(args)
        else:
            assert service_process(*args).wait(timeout_s=240) == 0
        return [json.loads(line)["metrics"] for line in (tmp_path / f"steps-{name}.jsonl").read_text().splitlines()]

    reported = run("one")
    single = weights(tmp_path / "one", 2)
    split = {"ep2": ["--expert-model-parallel-size", "2"], "tp2": ["--tensor-model-parallel-size", "2",
                                                                 "--sequence-parallel"]}[layout]  # fmt: skip
    reported_split = run(layout, *split)
    for step, step_split in zip(reported, reported_split, strict=True):
        assert step_split["loss"] == pytest.approx(step["loss"], rel=1e-4, abs=1e-6)
        if arch == "qwen3_moe":
            assert step["load_balancing_loss"] > 0
            assert step_split["load_balancing_loss"] == pytest.approx(step["load_balancing_loss"], rel=1e-5)
    if layout == "ep2":
        merged = _experts_merged(tmp_path / layout, ["mp_rank_00_000_000.pt", "mp_rank_00_000_001.pt"])
    else:
        folder = tmp_path / layout / "iter_0000002"
        shards = [torch.load(folder / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"] for r in range(2)]
        merged = {name: merge_tp_shards(name, [shard[name] for shard in shards]) for name in shards[0]}
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=1e-4, msg=name)
