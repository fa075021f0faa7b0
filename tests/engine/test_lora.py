"""LoRA adapters in the reference engine, as SGLang serves them under --enable-lora: peft folders loaded by name from
under --weight-disk-dir, one batch mixing adapters (lora_path per prompt) and the base model with the log-probs peft
computes for each, requests for unknown adapters refused, and an unload that waits for the sequences using it."""

import threading
import time

import httpx
import pytest
import torch

from tests.engine.test_weights import post

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def write_adapter(model_path, folder, seed: int, rank: int = 4, output_layer: bool = False):
    """A peft adapter on every linear layer of the model at `model_path` (with `output_layer`, the output layer
    too, which sees only the positions whose logits are kept), with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    targets = targets if output_layer else "all-linear"
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    peft_model.save_pretrained(folder, save_embedding_layers=False)  # the adapter alone, as the trainer writes it
    return peft_model


def logprobs_of(peft_model, adapter: bool, prompt: list[int], output: list[int]) -> list[float]:
    """The model's log-probs of `output` after `prompt`, with its adapter or without."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        if adapter:
            logits = peft_model(input_ids=ids).logits
        else:
            with peft_model.disable_adapter():
                logits = peft_model(input_ids=ids).logits
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    return logprobs.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.fixture
def adapters(tiny_model, tmp_path):
    root = tmp_path / "weights"
    return root, {name: write_adapter(tiny_model, root / name, seed, output_layer=name == "b")
                  for name, seed in (("a", 1), ("b", 2))}  # fmt: skip


def generate(url: str, lora_path, prompts=PROMPTS, max_new_tokens: int = 6, **extra) -> httpx.Response:
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    body = {"input_ids": prompts, "lora_path": lora_path, "return_logprob": True, "sampling_params": sampling, **extra}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_one_batch_mixes_adapters_and_the_base_model_with_peft_log_probs(start_engine, adapters):
    root, models = adapters
    url = start_engine("--enable-lora", "--max-lora-rank", "8", "--weight-disk-dir", str(root))
    for name in models:
        answer = post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(root / name)})
        assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert answer.json()["loaded_adapters"] == {"a": "a", "b": "b"}
    outputs = generate(url, ["a", None, "b"]).json()
    for prompt, output, adapter in zip(PROMPTS, outputs, ["a", None, "b"], strict=True):
        tokens = output["output_ids"]
        got = [entry[0] for entry in output["meta_info"]["output_token_logprobs"]]
        want = logprobs_of(models[adapter or "a"], adapter is not None, prompt, tokens)
        assert got == pytest.approx(want, abs=1e-4), adapter
    base = generate(url, None).json()
    assert [o["output_ids"] for o in base][1] == outputs[1]["output_ids"]
    assert [o["output_ids"] for o in base] != [o["output_ids"] for o in outputs]  # the adapters change the others


def test_bad_adapter_requests_are_refused_in_sglang_shape(start_engine, adapters, tmp_path, tiny_model):
    root, _ = adapters
    url = start_engine("--enable-lora", "--max-lora-rank", "2", "--weight-disk-dir", str(root))
    answer = generate(url, "missing")
    assert answer.status_code == 400 and "not loaded: missing" in answer.text
    outside = tmp_path / "outside"
    write_adapter(tiny_model, outside, 3, rank=2)
    answer = post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside)})
    assert answer.status_code == 400 and "is not under this engine's" in answer.json()["error_message"]
    answer = post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "a")})
    assert answer.status_code == 400 and "above --max-lora-rank 2" in answer.json()["error_message"]
    answer = post(url, "/unload_lora_adapter", {"lora_name": "a"})
    assert answer.status_code == 400 and "does not exist" in answer.json()["error_message"]
    assert generate(url, None).status_code == 200  # still serving


def test_without_enable_lora_an_adapter_request_is_refused(engine_url):
    answer = generate(engine_url, "a")
    assert answer.status_code == 400 and "LoRA is not enabled" in answer.text


def test_an_unload_stops_new_requests_at_once_and_waits_for_the_running_ones(start_engine, adapters):
    root, _ = adapters
    url = start_engine("--enable-lora", "--weight-disk-dir", str(root))
    post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "a")})
    ended: dict[str, tuple] = {}
    running = lambda: httpx.get(f"{url}/server_info").json()["internal_states"][0]["num_running_reqs"]  # noqa: E731

    def run(name: str, call) -> None:
        ended[name] = (call(), running())  # and the sequences still running in the engine when it ended

    long = threading.Thread(target=run, args=("long", lambda: generate(url, "a", PROMPTS[:1], 300).status_code))
    long.start()
    deadline = time.monotonic() + 60
    while running() == 0:
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.01)
    unload = threading.Thread(target=run, args=("unload", lambda: post(url, "/unload_lora_adapter",
                                                                         {"lora_name": "a"}).status_code))  # fmt: skip
    unload.start()
    while generate(url, "a", max_new_tokens=1).status_code != 400:  # refused once the unload arrived
        assert time.monotonic() < deadline, "new requests still use the adapter being unloaded"
    long.join(120)
    unload.join(120)
    assert ended["long"][0] == 200 and ended["unload"] == (200, 0)  # it waited for the running request
