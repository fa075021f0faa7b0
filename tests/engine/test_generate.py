"""/generate against transformers: greedy output, log-probs, batch and n > 1 ordering, batching under load, and
SGLang's error shapes for bad input."""

import asyncio
import json

import httpx
import pytest
import torch


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


PROMPTS = ["What is 1 + 2?", "Solve for x: 2x + 3 = 11", "The quick brown fox", "#### 42"]


def test_greedy_equals_transformers_and_logprobs_equal_a_forward_pass(engine_url, hf_model):
    model, tokenizer = hf_model
    url = engine_url
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}, "return_logprob": True}
    outputs = post(url, body).json()
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(ids, outputs, strict=True):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert out["output_ids"] == reference.tolist()[: len(out["output_ids"])]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(out["output_ids"])[:, None]
        )
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=1e-4)
        assert [tok for _, tok, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]


def test_input_logprobs_follow_sglang(engine_url, hf_model):
    model, tokenizer = hf_model
    url = engine_url
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    out = post(url, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                     "sampling_params": {"max_new_tokens": 1}}).json()  # fmt: skip
    entries = out["meta_info"]["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == prompt and entries[0][0] is None
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert entries[2][0] == pytest.approx(float(logprobs[1, prompt[2]]), abs=1e-4)


def test_meta_info_keys_in_sglang_order(engine_url):
    out = post(
        engine_url, {"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}, "return_logprob": True}
    ).json()
    assert list(out) == ["text", "output_ids", "meta_info"]
    assert list(out["meta_info"]) == [
        "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "input_token_logprobs",
        "output_token_logprobs", "output_token_logprobs_length", "reasoning_tokens", "completion_tokens",
        "cached_tokens", "weight_versions", "e2e_latency",
    ]  # fmt: skip
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_batch_and_n_follow_sglang_order(engine_url):
    url = engine_url
    outputs = post(url, {"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "sampling_params": {"max_new_tokens": 3, "n": 2},
                         "rid": "r"}).json()  # fmt: skip
    assert [o["meta_info"]["prompt_tokens"] for o in outputs] == [3, 3, 5, 5]  # i*n + j
    assert len({o["meta_info"]["id"] for o in outputs}) == 4  # each sample gets a fresh rid, as in SGLang
    single = post(url, {"input_ids": [[1, 2, 3], [4, 5]], "rid": "batch", "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in single.json()] == ["batch_0", "batch_1"]


def test_seeded_sampling_repeats(engine_url):
    url = engine_url
    body = {"text": "The quick", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}}
    assert post(url, body).json()["output_ids"] == post(url, body).json()["output_ids"]


def test_stop_strings_and_tokens(engine_url, hf_model):
    _, tokenizer = hf_model
    url = engine_url
    free = post(
        url, {"text": "What is", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    ).json()
    token = free["output_ids"][3]
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    stopped = post(url, {"text": "What is", "sampling_params": {**greedy, "stop_token_ids": [token]}}).json()
    assert stopped["output_ids"][-1] == token and stopped["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": token,
    }
    word = tokenizer.decode(free["output_ids"][2:4])
    cut = post(
        url,
        {
            "text": "What is",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [word]},
        },
    )
    result = cut.json()
    assert result["meta_info"]["finish_reason"]["matched"] == word and not result["text"].endswith(word)


def test_streaming_is_cumulative_and_ends_with_done(engine_url):
    url = engine_url
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_64_concurrent_requests_are_batched(engine_url):
    url = engine_url

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"text": "Count: 1 2 3", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            return await asyncio.gather(*(client.post(f"{url}/generate", json=body) for _ in range(64)))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 and len(r.json()["output_ids"]) == 16 for r in responses)
    sizes = httpx.get(f"{url}/server_info").json()["internal_states"][0]["batch_sizes"]
    assert max(map(int, sizes)) > 1, sizes


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"input_ids": []}, 400, {"error": {"message": "input_ids cannot be empty."}}),
        ({}, 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400,
         {"error": {"message": "max_new_tokens must be at least 0, got -1."}}),
        ({"input_ids": list(range(2000))}, 400,
         {"error": {"message": "The input (2000 tokens) is longer than the model's context length (1024 tokens)."}}),
    ],
)  # fmt: skip
def test_bad_input_gets_sglang_errors_and_the_engine_keeps_serving(engine_url, body, status, error):
    url = engine_url
    response = post(url, body)
    assert response.status_code == status and response.json() == error
    assert post(url, {"text": "still up", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_unknown_sampling_key(engine_url):
    response = post(engine_url, {"text": "x", "sampling_params": {"temprature": 1}})
    assert response.status_code == 400 and response.json()["error"].startswith("unknown field `temprature`, expected")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_other_model_families(arch, service_process, free_port, tmp_path):
    from transformers import AutoModelForCausalLM

    from services.train.tiny_checkpoint import write_tiny_model
    from tests.rollout.conftest import wait_healthy

    path = write_tiny_model(tmp_path / arch, arch=arch)
    port = free_port()
    url = wait_healthy(
        service_process("engine", "--model-path", str(path), "--port", str(port)), f"http://127.0.0.1:{port}"
    )
    prompt = [5, 17, 42, 99]
    out = post(url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert out["output_ids"] == reference[: len(out["output_ids"])]
    assert httpx.get(f"{url}/model_info").json()["model_type"] == arch
