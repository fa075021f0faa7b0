"""Weights sent by a separate process acting as the trainer (rank 0) over gloo, as SGLang receives them: per tensor
and as one flattened bucket. The engine loads them bit-identical, its outputs change, its version changes."""

import threading
import time

import httpx
import pytest
import torch

from services.weightsync.group import bucket_layout, flat_views, flatten, flatten_aligned, init_custom_process_group


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def in_background(function, *args):
    """Runs an HTTP call that blocks until rank 0 acts (SGLang's init and update calls do)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("response", function(*args)))
    thread.start()
    return thread, result


def join_group(url: str, free_port, group_name: str):
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"}  # fmt: skip
    thread, result = in_background(post, url, "/init_weights_update_group", body)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name)
    thread.join(60)
    assert result["response"].json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    return group


def send(url: str, group, group_name: str, named: dict[str, torch.Tensor], version: str, flat: bool) -> httpx.Response:
    assert post(url, "/begin_weight_update", {"selector": "all"}).json()["success"]
    body = {
        "names": list(named), "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()], "group_name": group_name, "weight_version": version,
        "load_format": "flattened_bucket" if flat else None,
    }  # fmt: skip
    thread, result = in_background(post, url, "/update_weights_from_distributed", body)
    if flat:
        torch.distributed.broadcast(flatten(list(named.values())), src=0, group=group)
    else:
        for tensor in named.values():
            torch.distributed.broadcast(tensor, src=0, group=group)
    thread.join(60)
    assert post(url, "/end_weight_update", {}).json()["success"]
    return result["response"]


def greedy(url: str) -> list[int]:
    body = {"text": "What is 1 + 2?", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"]


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flattened-bucket"])
def test_weights_over_gloo_are_loaded_bit_identical(start_engine, free_port, hf_model, flat):
    model, _ = hf_model
    url = start_engine()
    before = greedy(url)
    group_name = f"weights-{flat}"
    group = join_group(url, free_port, group_name)
    torch.manual_seed(1)
    named = {name: torch.randn_like(p) * 0.5 for name, p in model.named_parameters() if "layers.0." in name}
    named["lm_head.weight"] = torch.randn_like(model.lm_head.weight) * 3
    response = send(url, group, group_name, named, "v1", flat)
    assert response.json() == {"success": True, "message": "Succeeded to update model weights."}
    for name, tensor in named.items():
        got = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()
        assert torch.equal(torch.tensor(got, dtype=tensor.dtype), tensor), name
    assert greedy(url) != before
    info = httpx.get(f"{url}/model_info").json()
    assert info["weight_version"] == "v1"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    spans = httpx.post(f"{url}/generate", json=body).json()["meta_info"]["weight_versions"]
    assert spans == [{"version": "v1", "start": 0, "end": 3}]


def test_ordered_buckets_are_received_in_turn_whatever_order_they_arrive_in(start_engine, free_port, hf_model):
    """Several buckets in flight (`sequence`, offered in /server_info as ordered_weight_buckets): the engine posts
    each bucket's receives in its turn, so the last bucket, posted first, waits for the ones before it. The pauses
    only make the arrival order likely; the weights must be right in any order."""
    model, _ = hf_model
    url = start_engine()
    assert httpx.get(f"{url}/server_info").json()["ordered_weight_buckets"] is True
    group = join_group(url, free_port, "ordered")
    torch.manual_seed(3)
    params = [(name, torch.randn_like(p)) for name, p in model.named_parameters() if "layers.0." in name]
    buckets = [dict(params[i::3]) for i in range(3)]
    assert len({sum(t.numel() for t in b.values()) for b in buckets}) == 3  # a bucket out of turn cannot fit
    assert post(url, "/begin_weight_update", {"selector": "all"}).json()["success"]
    calls = []
    for sequence in (2, 1, 0):
        named = buckets[sequence]
        body = {"names": list(named), "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
                "shapes": [list(t.shape) for t in named.values()], "group_name": "ordered",
                "sequence": sequence}  # fmt: skip
        calls.append(in_background(post, url, "/update_weights_from_distributed", body))
        time.sleep(0.2)
    for named in buckets:  # in the sender's order
        for tensor in named.values():
            torch.distributed.broadcast(tensor, src=0, group=group)
    for thread, result in calls:
        thread.join(60)
        assert result["response"].json()["success"], result["response"].text
    assert post(url, "/end_weight_update", {}).json()["success"]
    for name, tensor in params:
        got = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()
        assert torch.equal(torch.tensor(got, dtype=tensor.dtype), tensor), name


def test_bad_updates_fail_in_sglang_shape_and_the_engine_keeps_serving(start_engine, free_port):
    url = start_engine()
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}
    assert post(url, "/update_weights_from_distributed", body).status_code == 400
    group = join_group(url, free_port, "bad")
    body["group_name"] = "bad"
    outside = post(url, "/update_weights_from_distributed", body).json()
    assert (
        not outside["success"]
        and "must run between begin_weight_update() and end_weight_update()" in outside["message"]
    )
    assert post(url, "/begin_weight_update", {"selector": "all"}).json()["success"]
    second = post(url, "/begin_weight_update", {"selector": "all"})
    assert second.status_code == 400 and not second.json()["success"]
    thread, result = in_background(post, url, "/update_weights_from_distributed", {**body, "names": ["no.such.weight"]})
    torch.distributed.broadcast(torch.zeros(1), src=0, group=group)
    thread.join(60)
    failed = result["response"]
    assert failed.status_code == 400 and "no parameter named 'no.such.weight'" in failed.json()["message"]
    assert post(url, "/end_weight_update", {}).json()["success"]
    assert len(greedy(url)) == 12
    missing = httpx.post(f"{url}/get_weights_by_name", json={"name": "nope"})
    assert missing.status_code == 400 and missing.json() == {"error": {"message": "Get parameter by name failed"}}


def test_update_weight_version(engine_url):
    reply = post(engine_url, "/update_weight_version", {"new_version": "7"}).json()
    assert reply == {"success": True, "message": "Weight version updated to 7", "new_version": "7"}
    assert httpx.get(f"{engine_url}/model_info").json()["weight_version"] == "7"


def test_weights_from_disk_are_loaded_from_under_the_weight_disk_dir_only(start_engine, hf_model, tmp_path):
    """/update_weights_from_disk reads the folder's indexed safetensors bit-identical and sets the version; a folder
    outside --weight-disk-dir, a missing one or one whose tensors the model lacks is refused in SGLang's shape, and
    the engine keeps its weights."""
    from safetensors.torch import save_file

    from services.trainer.export import write_index

    model, _ = hf_model
    root = tmp_path / "weights"
    folder = root / "weight_v000001"
    folder.mkdir(parents=True)
    torch.manual_seed(2)
    named = {name: torch.randn_like(p) for name, p in model.named_parameters() if "layers.1." in name}
    save_file(named, folder / "model-a.safetensors")
    save_file({"lm_head.weight": torch.zeros(1)}, folder / "model-stale.safetensors")  # no index names it
    write_index(folder, dict.fromkeys(named, "model-a.safetensors"), 0)
    url = start_engine("--weight-disk-dir", str(root))
    before = greedy(url)

    refused = {
        str(tmp_path): "is not under this engine's --weight-disk-dir",
        str(root / "weight_v000001" / ".." / ".."): "is not under",
        str(root / "weight_v000002"): "is not a folder",
    }
    for path, message in refused.items():
        answer = post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": "x"})
        assert answer.status_code == 400 and not answer.json()["success"] and message in answer.json()["message"]
    bad = root / "bad"
    bad.mkdir()
    save_file({"model.nonexistent.weight": torch.zeros(2)}, bad / "model.safetensors")
    answer = post(url, "/update_weights_from_disk", {"model_path": str(bad)}).json()
    assert not answer["success"] and "no parameter named 'model.nonexistent.weight'" in answer["message"]
    assert greedy(url) == before and httpx.get(f"{url}/model_info").json()["weight_version"] == "default"

    answer = post(url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "7"})
    assert answer.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    for name, tensor in named.items():
        got = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()
        assert torch.equal(torch.tensor(got, dtype=tensor.dtype), tensor), name
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == "7"
    assert greedy(url) != before


def test_an_engine_without_a_weight_disk_dir_loads_nothing_from_disk(engine_url, tiny_model):
    answer = post(engine_url, "/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert answer.status_code == 400 and "start it with --weight-disk-dir" in answer.json()["message"]


def test_a_buckets_tensors_are_placed_and_viewed_back_at_their_aligned_offsets():
    """The streamed layout's two halves: the sender copies tensors of mixed dtypes, strided views among them, into
    their aligned places (copy_all: by kind); the engine's loader views them back, 1-D, by one split a dtype
    (flat_views), tensors that share bytes included. A place that does not fit the buffer, aligned, is refused."""
    weight = torch.arange(24, dtype=torch.float32).view(4, 6)
    tensors = [weight[:, :3], torch.ones(5, dtype=torch.bfloat16), weight, torch.arange(3)]  # the first one strided
    dtypes, shapes = [t.dtype for t in tensors], [list(t.shape) for t in tensors]
    offsets, size = bucket_layout(dtypes, shapes)
    buffer = torch.zeros(size, dtype=torch.uint8)
    flatten_aligned(tensors, dtypes, shapes, buffer)
    views = flat_views(buffer, dtypes, [t.numel() for t in tensors], offsets)
    assert all(torch.equal(view, tensor.reshape(-1)) for view, tensor in zip(views, tensors, strict=True))
    shared = flat_views(buffer, [torch.float32] * 2, [12, 6], [offsets[2], offsets[2]])  # one tensor's bytes, twice
    assert torch.equal(shared[0], weight.reshape(-1)[:12]) and torch.equal(shared[1], weight.reshape(-1)[:6])
    for offset, numel in ((2, 1), (size, 1), (-4, 1)):
        with pytest.raises(ValueError, match="do not fit"):
            flat_views(buffer, [torch.float32], [numel], [offset])
