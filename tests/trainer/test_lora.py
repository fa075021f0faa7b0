"""LoRA in the trainer (services/trainer/lora.py): two steps with adapters on every linear layer under TP=2 (two
processes over gloo) end with the adapters of TP=1, the base weights untouched and no optimizer state for them; a
layer whose fused parts are targeted in part keeps the others' rows at 0; and the weights the engines are sent carry
the adapters folded in."""

import pytest
import torch

from services.trainer.hf_names import merge_tp_shards
from tests.trainer.conftest import trainer_args, weights

LORA = ["--num-rollout", "2", "--adam-eps", "1e-3", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]
COLUMN = ("linear_qkv", "linear_fc1")  # their B splits by rows with the output; the others' A by columns


def _merged(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    layer = name.rsplit(".", 2)[-2]
    split = (name.endswith("lora_B") and layer in COLUMN) or (name.endswith("lora_A") and layer not in COLUMN)
    if not split:  # the same on every rank
        torch.testing.assert_close(shards[0], shards[1], atol=1e-6, rtol=1e-5, msg=name)
        return shards[0]
    return merge_tp_shards(name.rsplit(".", 1)[0] + ".weight", shards)  # split as the layer's weight is


@pytest.fixture
def lora_single(filled_buffer, service_process, model, tmp_path):
    proc = service_process(*trainer_args(model, filled_buffer("one"), tmp_path / "one", *LORA))
    assert proc.wait(timeout_s=240) == 0, proc.log
    return tmp_path / "one"


def test_adapters_under_tp2_train_as_under_tp1_and_the_base_stays(lora_single, filled_buffer, model, tmp_path,
                                                                    service_process):  # fmt: skip
    single = weights(lora_single, 2)
    adapters = [n for n in single if n.endswith(("lora_A", "lora_B"))]
    assert len(adapters) == 2 * 4 * 2  # q/k/v (fused), o, gate/up (fused), down: 4 layers a block, 2 blocks
    assert all(single[n].abs().sum() > 0 for n in adapters)  # both trained (B first, then A through it)
    from safetensors.torch import load_file

    start = load_file(model / "model.safetensors")
    assert torch.equal(single["decoder.layers.0.mlp.linear_fc2.weight"], start["model.layers.0.mlp.down_proj.weight"])
    state = weights(lora_single, 2, "optimizer")["state"]
    assert len(state) == len(adapters)  # the frozen base has no optimizer state

    args = trainer_args(model, filled_buffer("tp"), tmp_path / "tp", *LORA, "--tensor-model-parallel-size", "2")
    proc = service_process(*args, nproc=2)
    assert proc.wait(timeout_s=300) == 0, proc.log[-4000:]
    shards = [torch.load(tmp_path / "tp" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    for name in adapters:
        got = _merged(name, [shard[name] for shard in shards])
        torch.testing.assert_close(got, single[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_fused_layer_targeted_in_part_keeps_the_other_parts_at_zero(filled_buffer, service_process, model,
                                                                       tmp_path):  # fmt: skip
    args = trainer_args(model, filled_buffer("q"), tmp_path / "q", *LORA, "--target-modules", "q_proj", "up_proj")
    proc = service_process(*args)
    assert proc.wait(timeout_s=240) == 0, proc.log
    trained = weights(tmp_path / "q", 2)
    assert not any("linear_proj.lora" in n or "linear_fc2.lora" in n for n in trained)
    b_qkv, b_fc1 = (
        trained["decoder.layers.0.self_attention.linear_qkv.lora_B"],
        trained["decoder.layers.0.mlp.linear_fc1.lora_B"],
    )
    half = b_fc1.shape[0] // 2
    assert b_fc1[:half].abs().sum() == 0 and b_fc1[half:].abs().sum() > 0  # gate not targeted, up is
    from services.trainer.models import read_hf_config

    hf = read_hf_config(model)
    head = hf["head_dim"]
    per_group = hf["num_attention_heads"] // hf["num_key_value_heads"]
    groups = b_qkv.view(hf["num_key_value_heads"], (per_group + 2) * head, -1)
    assert groups[:, : per_group * head].abs().sum() > 0 and groups[:, per_group * head :].abs().sum() == 0


def test_the_served_weights_carry_the_adapters(model):
    """served_tensors: W + alpha/rank * B A for an adapted layer, the weight itself elsewhere."""
    from services.trainer import lora
    from services.trainer.models import load_gpt_model, served_tensors
    from services.trainer.parallel import destroy_parallel, init_parallel

    init_parallel(tp_size=1)
    try:
        gpt_model, gpt = load_gpt_model(model)
        lora.apply(gpt_model, lora.LoraSettings(4, 8.0, 0.0, ("o_proj",)), gpt.shape)
        layer = gpt_model.decoder.layers[0].self_attention.linear_proj
        with torch.no_grad():
            layer.lora_B.normal_()
        served = served_tensors(gpt_model)
        expected = layer.weight + 2.0 * layer.lora_B @ layer.lora_A
        torch.testing.assert_close(served["decoder.layers.0.self_attention.linear_proj.weight"], expected.detach())
        assert "decoder.layers.0.self_attention.linear_proj.lora_A" not in served
        assert [n for n, p in gpt_model.named_parameters() if p.requires_grad] == [
            f"decoder.layers.{i}.self_attention.linear_proj.lora_{x}" for i in range(2) for x in "AB"
        ]
    finally:
        destroy_parallel()


def test_the_saved_adapter_loads_with_peft_and_gives_the_trainers_logprobs(filled_buffer, service_process, model,
                                                                           tmp_path):  # fmt: skip
    """--save-hf with LoRA writes a peft folder: peft puts it on the HF base model, whose log-probs (float32) are the
    trainer's own with the trained adapters (on every linear layer and the output layer)."""
    targets = ["all-linear", "lm_head"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.trainer import lora
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import destroy_parallel, init_parallel

    args = trainer_args(model, filled_buffer("hf"), tmp_path / "ckpt", *LORA, "--save-hf", str(tmp_path / "adapter"),
                        "--target-modules", *targets)  # fmt: skip
    proc = service_process(*args)
    assert proc.wait(timeout_s=240) == 0, proc.log
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tokens = torch.tensor([[3, 17, 29, 5, 11, 42, 8, 2, 19, 23]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                           tmp_path / "adapter").eval()  # fmt: skip
    with torch.no_grad():
        expected = torch.log_softmax(peft_model(input_ids=tokens).logits.float(), dim=-1)
    init_parallel(tp_size=1)
    try:
        trainer_model, gpt = load_gpt_model(model)
        lora.apply(trainer_model, lora.LoraSettings(4, 8.0, 0.0, tuple(targets)), gpt.shape)
        trained = weights(tmp_path / "ckpt", 2)
        trainer_model.load_state_dict(trained)
        positions = torch.arange(tokens.shape[1])[None]
        with torch.no_grad():
            logits = trainer_model(input_ids=tokens, position_ids=positions, attention_mask=None).float()
        got = torch.log_softmax(logits[..., : expected.shape[-1]], dim=-1)
        again, _ = load_gpt_model(model)  # --load of the folder: the same adapters
        lora.apply(again, lora.LoraSettings(4, 8.0, 0.0, tuple(targets)), gpt.shape)
        lora.load_adapter(again, gpt.shape, lora.LoraSettings(4, 8.0, 0.0, tuple(targets)), tmp_path / "adapter")
        loaded = {n: p for n, p in again.state_dict().items() if lora.is_adapter(n)}
        assert loaded and all(torch.equal(p, trained[n]) for n, p in loaded.items())
        with pytest.raises(ValueError, match=r"pass --lora-rank 4 --lora-alpha 8\.0 to continue them"):
            lora.load_adapter(again, gpt.shape, lora.LoraSettings(8, 8.0, 0.0, tuple(targets)), tmp_path / "adapter")
    finally:
        destroy_parallel()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_peft_folder_loaded_under_tp2_continues_as_under_tp1(filled_buffer, service_process, model, tmp_path):
    """--load of a peft folder (what --save-hf wrote) sets the adapters on every tensor-parallel rank: two more steps
    from it under TP=2 end where TP=1's do."""
    saved = tmp_path / "adapter"
    args = trainer_args(model, filled_buffer("first"), tmp_path / "first", *LORA, "--save-hf", str(saved))
    proc = service_process(*args)
    assert proc.wait(timeout_s=240) == 0, proc.log
    for name, extra, nproc in (("one", [], 1), ("tp", ["--tensor-model-parallel-size", "2"], 2)):
        args = trainer_args(model, filled_buffer(f"go-{name}"), tmp_path / name, *LORA, "--load", str(saved), *extra)
        proc = service_process(*args, nproc=nproc)
        assert proc.wait(timeout_s=300) == 0, proc.log[-4000:]
        assert "started from the LoRA adapters in" in proc.log
    single = weights(tmp_path / "one", 2)
    first = weights(tmp_path / "first", 2)
    shards = [torch.load(tmp_path / "tp" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    adapters = [n for n in single if n.endswith(("lora_A", "lora_B"))]
    assert adapters and any(not torch.equal(single[n], first[n]) for n in adapters)  # two more steps moved them
    for name in adapters:
        got = _merged(name, [shard[name] for shard in shards])
        torch.testing.assert_close(got, single[name], atol=1e-5, rtol=1e-4, msg=name)


def test_an_adapter_on_the_output_layer_refuses_log_probs_from_hidden_states():
    from services.trainer.config import TrainerConfig

    settings = {"rollout_batch_size": 1, "n_samples_per_prompt": 2, "global_batch_size": 2, "lora_rank": 4}
    TrainerConfig(**settings, target_modules=["all-linear"], log_probs_from_hidden=True)
    with pytest.raises(ValueError, match="drop lm_head from --target-modules, or --log-probs-from-hidden"):
        TrainerConfig(**settings, target_modules=["all-linear", "lm_head"], log_probs_from_hidden=True)
