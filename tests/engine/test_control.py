"""Pause and continue (abort, retract, in place), aborts by rid, health while paused, and the real sglang-router
routing /generate to two engines."""

import subprocess
import sys
import threading
import time

import httpx


def generate_later(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("r", httpx.post(f"{url}/generate", json=body, timeout=120))
    )
    thread.start()
    return thread, result


# Long enough (about 2 s on the 2-core machine) that pausing or aborting after 0.3-0.5 s finds it still running.
LONG = {"text": "Count", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}, "rid": "long-1"}


def test_abort_by_rid_returns_the_partial_output(engine_url):
    thread, result = generate_later(engine_url, LONG)
    time.sleep(0.5)
    assert httpx.post(f"{engine_url}/abort_request", json={"rid": "long-1"}).status_code == 200
    thread.join(60)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 1000


def test_pause_in_place_then_continue_finishes_the_request(engine_url):
    thread, result = generate_later(
        engine_url, {**LONG, "rid": "long-2", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    )
    time.sleep(0.3)
    paused = httpx.post(f"{engine_url}/pause_generation", json={"mode": "in_place"})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert httpx.get(f"{engine_url}/health", timeout=30).status_code == 503
    assert thread.is_alive()
    resumed = httpx.post(f"{engine_url}/continue_generation", json={})
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    thread.join(60)
    assert len(result["r"].json()["output_ids"]) == 1000


def test_pause_retract_keeps_the_output_and_counts_the_retraction(engine_url):
    thread, result = generate_later(
        engine_url, {**LONG, "rid": "long-3", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    )
    time.sleep(0.3)
    httpx.post(f"{engine_url}/pause_generation", json={"mode": "retract"})
    httpx.post(f"{engine_url}/continue_generation", json={})
    thread.join(60)
    out = result["r"].json()
    assert len(out["output_ids"]) == 1000 and out["meta_info"]["num_retractions"] == 1


def test_pause_abort_ends_in_flight_requests(engine_url):
    thread, result = generate_later(engine_url, {**LONG, "rid": "long-4"})
    time.sleep(0.3)
    httpx.post(f"{engine_url}/pause_generation", json={"mode": "abort"})
    thread.join(60)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    httpx.post(f"{engine_url}/continue_generation", json={})
    assert httpx.get(f"{engine_url}/health", timeout=30).status_code == 200


def test_info_routes(engine_url):
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{engine_url}{path}").json()
        assert info["model_type"] == "qwen3" and info["is_generation"] is True
    server = httpx.get(f"{engine_url}/get_server_info").json()
    assert server["tp_size"] == 1 and server["internal_states"][0]["num_running_reqs"] >= 0
    flushed = httpx.post(f"{engine_url}/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")


def test_a_prompt_seen_before_comes_from_the_prefix_cache_until_it_is_flushed(engine_url):
    body = {"input_ids": list(range(3, 60)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    def cached() -> int:
        return httpx.post(f"{engine_url}/generate", json=body, timeout=60).json()["meta_info"]["cached_tokens"]

    cached()
    assert cached() == 48  # three full blocks of 16; the block of the last prompt token is computed again
    assert httpx.post(f"{engine_url}/flush_cache").status_code == 200
    assert cached() == 0


def test_sglang_router_routes_to_two_engines(start_engine, free_port):
    urls = start_engine.many([(), ()], [None, None])
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin",
           "--prometheus-port", str(free_port())]  # fmt: skip
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        body = {
            "text": "What is 1 + 2?",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        deadline, answered = time.monotonic() + 90, []
        while time.monotonic() < deadline and len(answered) < 8:
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=30)
                if response.status_code == 200:
                    answered.append(response.json())
            except httpx.HTTPError:
                time.sleep(0.5)
        assert len(answered) == 8 and all(len(a["output_ids"]) == 4 for a in answered)
        served = [
            sum(httpx.get(f"{url}/server_info").json()["internal_states"][0]["batch_sizes"].values()) for url in urls
        ]
        prefills = [httpx.get(f"{url}/server_info").json()["internal_states"][0] for url in urls]
        assert all(s > 0 for s in served), (served, prefills)
    finally:
        router.terminate()
        router.wait(30)
