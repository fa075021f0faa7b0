"""SGLang's return_routed_experts on the reference engine: every position's top-k expert ids per layer, for Qwen3-MoE,
GLM-4.5 and DeepSeek-V3, equal to what the model chooses when it runs the whole sequence in one forward pass."""

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.train.tiny_checkpoint import write_tiny_model

PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13]]
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe", "deepseek_v3"])
def moe_model(request, tmp_path_factory):
    return write_moe_model(tmp_path_factory.mktemp(request.param), request.param)


def write_moe_model(path, arch: str):
    path = write_tiny_model(path, arch=arch)
    if arch == "qwen3_moe":  # its routers start 0.02 wide, with near-ties that float noise could flip
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(15)
        model.save_pretrained(path)
    return path


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def decode(out: dict, num_layers: int, top_k: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
    return flat.reshape(-1, num_layers, top_k)


def reference_routing(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), num_layers, top_k]: each MoE router's chosen ids in one forward pass over `tokens` (0 for dense
    layers), taken from the router's output as the model's experts use them."""
    config = model.config
    routing = np.zeros((len(tokens), config.num_hidden_layers, config.num_experts_per_tok), dtype=np.int32)
    handles = []
    for layer_id, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if hasattr(router, "top_k"):
            record = lambda m, a, out, i=layer_id: routing.__setitem__((slice(None), i), out[2].numpy())  # noqa: E731
            handles.append(router.register_forward_hook(record))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for handle in handles:
        handle.remove()
    return routing


def moe_layers(config) -> list[int]:
    first_dense = getattr(config, "first_k_dense_replace", 0)
    return list(range(first_dense, config.num_hidden_layers))


def test_routed_experts_equal_a_full_forward_pass(moe_model, start_engine):
    url = start_engine("--model-path", str(moe_model), "--enable-return-routed-experts")
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    config = model.config
    num_layers, top_k = config.num_hidden_layers, config.num_experts_per_tok
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    batch = {"input_ids": PROMPTS, "sampling_params": {**sampling, "n": 2}, "return_routed_experts": True}
    single = {"input_ids": PROMPTS[0][:4], "sampling_params": sampling, "return_routed_experts": True}
    with ThreadPoolExecutor(2) as pool:  # the single one joins the batch's decoding (or the other way round)
        batch_future, single_future = pool.submit(post, url, batch), pool.submit(post, url, single)
        outputs = [*batch_future.result().json(), single_future.result().json()]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0][:4]]  # n=2: i*n + j
    for prompt, out in zip(prompts, outputs, strict=True):
        routing = decode(out, num_layers, top_k)
        assert routing.shape == (len(prompt) + len(out["output_ids"]) - 1, num_layers, top_k)
        dense = [layer for layer in range(num_layers) if layer not in moe_layers(config)]
        assert (routing[:, dense] == 0).all()
        moe = routing[:, moe_layers(config)]
        assert ((moe >= 0) & (moe < num_experts)).all()
        assert (np.sort(moe, -1)[..., 1:] != np.sort(moe, -1)[..., :-1]).all()  # top-k ids are distinct
        expected = reference_routing(model, prompt + out["output_ids"][:-1])
        np.testing.assert_array_equal(np.sort(routing, -1), np.sort(expected, -1))  # the k ids' order is free


def test_start_len_streaming_and_retraction(start_engine, tmp_path):
    path = write_moe_model(tmp_path / "moe", "qwen3_moe")
    url = start_engine("--model-path", str(path), "--enable-return-routed-experts")
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True}  # fmt: skip
    full = post(url, body).json()["meta_info"]["routed_experts"]
    tail = post(url, {**body, "routed_experts_start_len": 4}).json()["meta_info"]["routed_experts"]
    assert base64.b64decode(tail) == base64.b64decode(full)[4 * 2 * 2 * 4 :]  # 4 rows of 2 layers x top-2 int32
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as response:
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line)["meta_info"] for line in lines]
    assert [c.get("routed_experts") for c in chunks] == [None] * (len(chunks) - 1) + [full]  # only the last has it
    bad = post(url, {**body, "routed_experts_start_len": 7})
    assert bad.status_code == 400 and "routed_experts_start_len" in bad.json()["error"]["message"]

    sampling = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate", json={**body, "sampling_params": sampling, "stream": True},
                      timeout=60) as response:  # fmt: skip
        lines = (line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: {"))
        next(lines)  # decoding has begun: retract it, so that a prefill over prompt and output routes it again
        httpx.post(f"{url}/pause_generation", json={"mode": "retract"})
        httpx.post(f"{url}/continue_generation", json={})
        out = json.loads(list(lines)[-1])
    assert out["meta_info"]["num_retractions"] == 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = reference_routing(model, PROMPTS[0] + out["output_ids"][:-1])
    np.testing.assert_array_equal(np.sort(decode(out, 2, 2), -1), np.sort(expected, -1))


def test_without_the_server_option_the_key_is_absent(start_engine, tmp_path):
    path = write_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    url = start_engine("--model-path", str(path))
    out = post(url, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True})
    assert "routed_experts" not in out.json()["meta_info"]
    bad = post(url, {"input_ids": PROMPTS[0], "return_routed_experts": True, "routed_experts_start_len": -1})
    assert bad.status_code == 400  # SGLang checks the start even without the option


def test_dense_model_with_the_option_does_not_start(service_process, free_port, tiny_model):
    """SGLang 0.5.23 fails at start too: its capturer reads num_experts_per_tok, which a dense config lacks."""
    proc = service_process("engine", "--model-path", str(tiny_model), "--port", str(free_port()),
                           "--enable-return-routed-experts")  # fmt: skip
    assert proc.proc.wait(120) != 0
    assert "--enable-return-routed-experts needs an MoE model" in proc.log and "drop the flag" in proc.log
