"""The trainer's model layer against HF transformers on CPU: a Megatron GPTModel built from an HF checkpoint gives HF's
log-probs (Qwen3, Qwen2, Llama, tied embeddings, rope scaling), TP=2 over gloo gives TP=1's, and HF → Megatron → HF
is bit-identical.

Run as a module (`python -m tests.trainer.test_models OUT DIR...` under torchrun), this file is the TP=2 worker.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.processes import free_port
from services.engine.checkpoint_names import parameter_view
from services.train.tiny_checkpoint import write_tiny_model
from services.trainer.hf_names import hf_to_megatron, megatron_to_hf, merge_tp_shards
from services.trainer.models import (
    SafetensorsWeights,
    WeightViews,
    gpt_config_from_hf,
    hf_weights_of,
    load_gpt_model,
    read_hf_config,
    token_logprobs,
)

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["What is 1 + 2? The answer is 3.", "Let me think step by step. First add the numbers, then check."]


def _token_ids(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # Long enough (~100 tokens) that rope scaling changes the low-frequency rotations measurably.
    rows = [tokenizer(" ".join([text] * 8))["input_ids"] for text in TEXTS]
    length = min(len(row) for row in rows)
    return torch.tensor([row[:length] for row in rows])


def _megatron_logprobs(model, config, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None)
        return token_logprobs(logits[:, :-1], ids[:, 1:], config.shape.vocab_size)


def _hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(hf_dir)(ids).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def _write_tied(path: Path) -> Path:
    """A Qwen3 checkpoint with tie_word_embeddings (like Qwen3-0.6B): no lm_head tensor on disk."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    write_tiny_model(path, arch="qwen3", seed=3)
    config = Qwen3Config.from_pretrained(path)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _with_rope(path: Path, arch: str, rope: dict) -> Path:
    write_tiny_model(path, arch=arch, seed=1)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (path / "config.json").write_text(json.dumps(config))
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# GLM-4.5 with QK norms, no biases, two dense layers and groups of experts (4, the best 2 kept); DeepSeek-V3 without
# q_lora_rank (Moonlight, DeepSeek-V2-Lite), with Kimi K2's / Moonlight's routing (one group) and plain rope.
GLM4_MOE_VARIANT = dict(use_qk_norm=True, attention_bias=False, n_group=4, topk_group=2, num_experts_per_tok=4,
                        n_shared_experts=2, first_k_dense_replace=2, num_hidden_layers=4)  # fmt: skip
DEEPSEEK_V3_VARIANT = dict(q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
CHECKPOINTS = {
    "qwen3": lambda path: write_tiny_model(path, arch="qwen3"),
    "qwen2": lambda path: write_tiny_model(path, arch="qwen2"),
    "llama": lambda path: write_tiny_model(path, arch="llama"),
    "qwen3-tied": _write_tied,
    "llama-rope-llama3": lambda p: _with_rope(p, "llama", {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}),
    "qwen2-rope-linear": lambda p: _with_rope(p, "qwen2", {"rope_type": "linear", "factor": 4.0}),
    "qwen3-moe": lambda path: write_tiny_model(path, arch="qwen3_moe"),
    "glm4": lambda path: write_tiny_model(path, arch="glm4"),
    "glm4-moe": lambda path: write_tiny_model(path, arch="glm4_moe"),
    "glm4-moe-qk-norm-groups": lambda path: write_tiny_model(path, arch="glm4_moe", **GLM4_MOE_VARIANT),
    "deepseek-v3": lambda path: write_tiny_model(path, arch="deepseek_v3"),
    "deepseek-v3-no-q-lora": lambda path: write_tiny_model(path, arch="deepseek_v3", **DEEPSEEK_V3_VARIANT),
}
MOE = ("qwen3-moe", "glm4-moe", "deepseek-v3")
FAMILIES = ("qwen2", "qwen3", "qwen3-tied", "glm4", *MOE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write(root / name) for name, write in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def megatron_tp1():
    """This pytest process as a world of one (gloo, TP=1)."""
    from services.trainer.parallel import destroy_parallel, init_parallel

    yield init_parallel(tp_size=1)
    destroy_parallel()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_megatron_logprobs_equal_hf(name: str, checkpoints: dict[str, Path], megatron_tp1) -> None:
    hf_dir = checkpoints[name]
    model, config = load_gpt_model(hf_dir)
    ids = _token_ids(hf_dir)
    assert ids.shape[1] >= 64
    assert config.shape.padded_vocab_size == 512 > config.shape.vocab_size  # the padding is exercised
    megatron = _megatron_logprobs(model.eval(), config, ids)
    hf = _hf_logprobs(hf_dir, ids)
    torch.testing.assert_close(megatron, hf, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen3-tied", "glm4", "glm4-moe", "deepseek-v3"])
def test_gradients_equal_hf(name: str, checkpoints: dict[str, Path], megatron_tp1) -> None:
    """Training through the Megatron model moves every weight as training the HF model would."""
    hf_dir = checkpoints[name]
    ids = _token_ids(hf_dir)
    model, config = load_gpt_model(hf_dir)
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    token_logprobs(logits[:, :-1], ids[:, 1:], config.shape.vocab_size).mean().backward()
    megatron_grads = {}
    for megatron_name, param in model.named_parameters():
        megatron_grads.update(megatron_to_hf(megatron_name, param.grad, config.shape))
    hf = _hf_model(hf_dir)
    hf_logits = hf(ids).logits[:, :-1]
    torch.log_softmax(hf_logits, dim=-1).gather(-1, ids[:, 1:, None]).mean().backward()
    hf_grads = {key: param.grad for key, param in hf.named_parameters()}
    # transformers fuses each layer's experts in memory; the checkpoint (and Megatron) names each expert
    hf_grads = {key: parameter_view(hf_grads, key) for key in megatron_grads}
    assert all(grad is not None for grad in hf_grads.values())
    for key, grad in hf_grads.items():
        torch.testing.assert_close(megatron_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)


def test_logits_are_the_output_layers_own_memory(checkpoints: dict[str, Path], megatron_tp1) -> None:
    """The output layer writes the logits batch-first, so GPTModel's [s, b] → [b, s] transpose copies nothing."""
    model, _ = load_gpt_model(checkpoints["qwen3"])
    written = []
    model.output_layer.register_forward_hook(lambda layer, args, output: written.append(output[0]))
    ids = _token_ids(checkpoints["qwen3"])
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    assert logits.shape[:2] == ids.shape and logits.data_ptr() == written[0].data_ptr()


def test_round_trip_is_bit_identical(checkpoints: dict[str, Path], megatron_tp1, tmp_path: Path) -> None:
    from services.trainer.export import export_hf_checkpoint

    for name in FAMILIES:
        source, out = checkpoints[name], tmp_path / name
        model, config = load_gpt_model(source)
        export_hf_checkpoint(model, config, source, out)
        original, exported = SafetensorsWeights(source), SafetensorsWeights(out)
        assert sorted(exported) == sorted(original)
        for key in original:
            assert torch.equal(exported[key], original[key]), key
        assert read_hf_config(out) == read_hf_config(source)
        ids = _token_ids(out)
        with torch.no_grad():
            assert torch.equal(_hf_model(out)(ids).logits, _hf_model(source)(ids).logits)


def test_weight_views_are_the_converted_weights_and_follow_the_parameters(checkpoints: dict[str, Path], megatron_tp1):
    """What the streamed weight sync copies into its buckets with nothing converted: each view holds its HF tensor's
    elements in order, after the weights change in place too, and a parameter whose storage moved is viewed anew."""
    for name in FAMILIES:
        model, config = load_gpt_model(checkpoints[name])
        views = WeightViews(model, config)
        _check_views(views, model, config)
        assert views() is views()  # made once
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        _check_views(views, model, config)
        params = dict(model.named_parameters())
        param = next((p for n, p in params.items() if "linear_qkv.weight" in n), next(iter(params.values())))
        param.data = param.data.clone()  # its storage moved: the views follow it
        with torch.no_grad():
            param.mul_(2.0)
        _check_views(views, model, config)


def _check_views(views: WeightViews, model, config) -> None:
    expected = list(hf_weights_of(model, config))
    assert [(n, tuple(s)) for n, _, s in views()] == [(n, tuple(t.shape)) for n, t in expected]
    for (hf_name, view, shape), (_, tensor) in zip(views(), expected, strict=True):
        assert torch.equal(view.reshape(shape), tensor), hf_name


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_tp_shards_merge_back_to_hf(checkpoints: dict[str, Path], tp_size: int, fused_norms: bool) -> None:
    """Pure conversion at TP=4 too, where the 2 KV heads are fewer than the ranks and QKV groups are split."""
    for name in (*FAMILIES, "glm4-moe-qk-norm-groups", "deepseek-v3-no-q-lora"):
        weights = SafetensorsWeights(checkpoints[name])
        config = gpt_config_from_hf(read_hf_config(checkpoints[name]), tp_size=tp_size)
        experts = {"etp_size": tp_size}  # the experts split as the dense layers, megatron's default
        ranks = [dict(hf_to_megatron(weights, config.shape, rank, tp_size, fused_norms, etp_rank=rank, **experts))
                 for rank in range(tp_size)]  # fmt: skip
        back = {}
        for megatron_name in ranks[0]:
            full = merge_tp_shards(megatron_name, [shards[megatron_name] for shards in ranks])
            back.update(megatron_to_hf(megatron_name, full, config.shape))
        assert sorted(back) == sorted(weights)
        assert all(torch.equal(back[key], weights[key]) for key in weights)


@pytest.mark.parametrize(
    ("change", "tp_size", "message"),
    [
        ({}, 3, "num_attention_heads 4 is not divisible by tensor-parallel size 3"),
        ({"intermediate_size": 100}, 8, "intermediate_size 100 is not divisible by tensor-parallel size 8"),
        ({"num_key_value_heads": 3}, 1, "num_attention_heads 4 is not divisible by num_key_value_heads 3"),
        ({"model_type": "gemma3"}, 1, "model_type 'gemma3' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 1, "rope_type 'yarn' is not supported"),
    ],
)
def test_contradicting_config_names_the_numbers(
    checkpoints: dict[str, Path], change: dict, tp_size: int, message: str
) -> None:
    hf = {**read_hf_config(checkpoints["qwen3"]), **change}
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf(hf, tp_size=tp_size)


LAYOUTS = {"tp2": (FAMILIES, {"tp_size": 2}), "ep2": (MOE, {"ep_size": 2})}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_over_gloo_equal_one(checkpoints: dict[str, Path], megatron_tp1, tmp_path: Path, layout: str) -> None:
    """TP=2 (the experts split over the same ranks), and for MoE EP=2 (each rank holds half the experts and tokens go
    to them by all-gather): the log-probs of one rank, the weights gathered back, an HF export."""
    names = LAYOUTS[layout][0]
    dirs = [str(checkpoints[name]) for name in names]
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(port), "-m", "tests.trainer.test_models", str(tmp_path), layout, *dirs]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    tp2 = torch.load(tmp_path / "tp2.pt")
    for name, hf_dir in zip(names, dirs, strict=True):
        model, config = load_gpt_model(hf_dir)
        tp1 = _megatron_logprobs(model.eval(), config, _token_ids(Path(hf_dir)))
        torch.testing.assert_close(tp2[hf_dir]["logprobs"], tp1, atol=1e-5, rtol=0)
        torch.testing.assert_close(tp2[hf_dir]["gathered"], tp1, atol=1e-5, rtol=0)
        assert tp2[hf_dir]["weights_equal"], f"{name}: TP=2 shards gathered back differ from the checkpoint"
        exported, original = SafetensorsWeights(tmp_path / name), SafetensorsWeights(hf_dir)
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[key], original[key]) for key in original)


def _tp_worker(out_dir: Path, layout: str, hf_dirs: list[str]) -> None:
    """One torchrun rank at TP=2 or EP=2: log-probs through the vocab-parallel path and from gathered logits, the
    gathered weights compared with the checkpoint, and an HF export written by rank 0."""
    from megatron.core import tensor_parallel

    from services.trainer.export import export_hf_checkpoint
    from services.trainer.models import hf_weights_of
    from services.trainer.parallel import destroy_parallel, init_parallel

    info = init_parallel(**LAYOUTS[layout][1])
    results = {}
    for hf_dir in hf_dirs:
        model, config = load_gpt_model(hf_dir)
        ids = _token_ids(Path(hf_dir))
        logprobs = _megatron_logprobs(model.eval(), config, ids)
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., : config.shape.vocab_size]
        gathered = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        original = SafetensorsWeights(hf_dir)
        weights_equal = all(torch.equal(tensor, original[key]) for key, tensor in hf_weights_of(model, config))
        export_hf_checkpoint(model, config, hf_dir, out_dir / Path(hf_dir).name)
        results[hf_dir] = {"logprobs": logprobs, "gathered": gathered, "weights_equal": weights_equal}
    if info.rank == 0:
        torch.save(results, out_dir / "tp2.pt")
    destroy_parallel()


if __name__ == "__main__":
    _tp_worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
