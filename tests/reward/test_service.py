"""The reward service for real: isolated workers with deadlines, plugins that hang, raise or crash, bad input,
custom and group functions, and a reward model plugin on a tiny HF model."""

import pytest
from google.protobuf.struct_pb2 import Struct

from services.common.clients import health_status
from services.train.tiny_checkpoint import write_classifier
from slipstream.v1 import reward_pb2, reward_pb2_grpc
from tests.reward.conftest import error_code, items, score


def test_built_in_types_in_one_batch(reward_service):
    stub = reward_service()
    results = score(
        stub,
        ("so \\boxed{\\frac{1}{2}}", "0.5"),
        ("Answer: 12", "12", "dapo"),
        ("#### 7", "7", "gsm8k"),
        ("the answer is (B)", "B", "multiple_choice"),
        ("wrong \\boxed{3}", "4"),
    )
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert [r.item_id for r in results] == ["i0", "i1", "i2", "i3", "i4"]
    assert results[1].details["acc"] == 1.0 and results[1].text_details["pred"] == "12"
    assert not any(r.error for r in results)


def test_rm_type_from_metadata(reward_service):
    stub = reward_service()
    metadata = Struct()
    metadata.update({"rm_type": "exact"})
    request = reward_pb2.ScoreRequest(items=items(("Paris", "paris"), metadata=metadata))
    assert stub.Score(request, timeout=30).results[0].reward == 1.0


def test_a_type_the_service_is_not_set_to_is_scored_too(reward_service):
    """Set to `exact`, the workers do not warm math-verify: an item of type math imports it on its first item."""
    stub = reward_service(rm_type="exact", num_workers=1)
    results = score(stub, ("Paris", "paris"), ("so \\boxed{\\frac{1}{2}}", "0.5", "math"))
    assert [r.reward for r in results] == [1.0, 1.0] and not any(r.error for r in results)


def test_bad_input_gets_defined_results(reward_service):
    stub = reward_service(rm_timeout_s=20)
    huge = "1 + 1 = 2. " * 400_000 + "\\boxed{2}"  # ~4.4 MB
    results = score(stub, (b"\\boxed{4}\xff\xfe", "4"), ("", "4"), (huge, "2"), ("\\boxed{4}", ""))
    assert results[0].reward == 1.0 and not results[0].error  # invalid UTF-8 is replaced, then scored
    assert results[1].reward == 0.0 and not results[1].error  # an empty response is simply wrong
    assert results[2].reward == 1.0 or results[2].error  # scored, or timed out: never a dead service
    assert results[3].error and "label is empty" in results[3].error_message


def test_unknown_reward_type_names_the_item(reward_service):
    stub = reward_service()
    code, details = error_code(lambda: score(stub, ("a", "a"), ("b", "b", "regex_magic")))
    assert code.name == "INVALID_ARGUMENT"
    assert details.startswith("items[1].rm_type: unknown reward type 'regex_magic'; use one of math")
    code, details = error_code(lambda: score(stub, ("a", "a", "remote_rm")))
    assert code.name == "INVALID_ARGUMENT" and "--rm-url" in details


def test_a_hanging_verifier_times_out_and_the_next_batch_is_scored(reward_service, plugin):
    stub = reward_service(custom_rm_path=f"{plugin}:slow_or_broken", rm_timeout_s=1.0, reward_on_error=-1.0)
    results = score(stub, ("hang", "x"), ("fine", "x"))
    assert results[0].error and results[0].reward == -1.0 and "timeout" in results[0].error_message
    assert not results[1].error and results[1].reward == 4.0
    again = score(stub, ("next", "x"), ("batch", "xy"))
    assert [r.reward for r in again] == [4.0, 5.0] and again[1].details["label_len"] == 2.0
    assert again[0].text_details["verdict"] == "ok"


def test_a_plugin_that_raises_or_crashes_costs_only_its_item(reward_service, plugin):
    stub = reward_service(custom_rm_path=f"{plugin}:slow_or_broken")
    results = score(stub, ("raise", "x"), ("crash", "x"), ("ok", "x"))
    assert results[0].error and "exception: ValueError: the judge refused" in results[0].error_message
    assert f"(custom {plugin}:slow_or_broken)" in results[0].error_message  # the function, not a built-in's name
    assert (results[0].rm_type, results[0].error_kind) == ("custom", "exception")
    assert "raise ValueError" in results[0].error_traceback  # the function's own line
    assert results[1].error and "crash" in results[1].error_message and results[1].error_kind == "crash"
    assert not results[2].error and results[2].reward == 2.0
    assert score(stub, ("still here", "x"))[0].reward == 10.0


def test_a_plugin_past_the_memory_limit_costs_only_its_item_and_its_worker_is_replaced(reward_service, plugin):
    stub = reward_service(custom_rm_path=f"{plugin}:slow_or_broken", reward_worker_memory_mb=512, num_workers=1)
    results = score(stub, ("hog", "x"), ("ok", "x"))
    assert results[0].error and "memory: needed more than the worker's 512 MiB" in results[0].error_message
    assert "--reward-worker-memory-mb" in results[0].error_message
    assert not results[1].error and results[1].reward == 2.0  # on the one worker, started again
    assert score(stub, ("still here", "x"))[0].reward == 10.0


def test_the_service_keeps_serving_after_a_worker_ran_out_of_memory_or_hung(
    service_process, wait_serving, free_port, plugin, channel_to
):
    """`slipstream reward` for real with one worker: a function that leaks past --reward-worker-memory-mb fails its
    item naming the limit, one that hangs fails its item naming the deadline; each time the worker is a new process,
    the health check says SERVING and the next batch is scored."""
    port = free_port()
    proc = service_process("reward", "--port", str(port), "--custom-rm-path", f"{plugin}:slow_or_broken",
                           "--reward-worker-memory-mb", "256", "--num-workers", "1", "--rm-timeout-s", "5")  # fmt: skip
    wait_serving(f"127.0.0.1:{port}", proc)
    channel = channel_to(f"127.0.0.1:{port}")
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    pids = [score(stub, ("pid", "x"))[0].reward]
    for bad, expected in (("leak", "memory: needed more than the worker's 256 MiB (raise --reward-worker-memory-mb"),
                          ("hang", "timeout: did not finish within 5s (raise --rm-timeout-s")):  # fmt: skip
        failed = score(stub, (bad, "x"))[0]
        assert failed.error and expected in failed.error_message and failed.reward == 0.0
        assert health_status(channel, "", timeout_s=10) == "SERVING"
        after = score(stub, ("pid", "x"), ("next", "x"))
        assert not any(r.error for r in after) and after[1].reward == 4.0
        pids.append(after[0].reward)
    assert len(set(pids)) == 3, f"worker pids {pids}: a worker that ran out of memory or hung must be replaced"
    assert proc.terminate() == 0


def test_no_request_names_code_to_load(reward_service, plugin, tmp_path):
    """A request's reward type (the field, or metadata.rm_type) picks among the built-in types only; with a
    --custom-rm-path it is that function that scores, whatever a request names. Nothing a request names is imported."""
    marker = tmp_path / "imported"
    (evil := tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef score(args, sample):\n"
                                              "    return 99.0\n")  # fmt: skip
    named = [f"{evil}:score", "evil:score", f"file://{evil}", "os:system"]
    metadata = Struct()
    metadata.update({"rm_type": named[0]})
    stub = reward_service()
    for rm_type in named:
        code, details = error_code(lambda rm_type=rm_type: score(stub, ("a", "a", rm_type)))
        assert code.name == "INVALID_ARGUMENT" and f"unknown reward type {rm_type!r}" in details
    code, _ = error_code(lambda: stub.Score(reward_pb2.ScoreRequest(items=items(("a", "a"), metadata=metadata))))
    assert code.name == "INVALID_ARGUMENT"
    custom = reward_service(custom_rm_path=f"{plugin}:slow_or_broken")
    results = [
        *score(custom, *[("abc", "x", rm_type) for rm_type in named]),
        *score(custom, ("abc", "x"), rm_type=named[0]),
    ]
    request = reward_pb2.ScoreRequest(items=items(("abc", "x"), metadata=metadata))
    results += custom.Score(request, timeout=60).results
    assert [r.reward for r in results] == [3.0] * (len(named) + 2)  # slow_or_broken's len(response), never 99
    assert not marker.exists()


def test_async_custom_function(reward_service, plugin):
    stub = reward_service(custom_rm_path=f"{plugin}:async_judge")
    assert [r.reward for r in score(stub, ("it is 42", "42"), ("it is 41", "42"))] == [1.0, 0.0]


def test_group_reward_function(reward_service, plugin):
    stub = reward_service(custom_rm_path=f"{plugin}:rank_group", group_rm=True)
    results = score(stub, ("long response", ""), ("short", ""), ("medium one", ""), group=True)
    assert [r.reward for r in results] == [2.0, 0.0, 1.0]


def test_reward_key_picks_the_trained_component(reward_service):
    stub = reward_service(rm_type="f1", reward_key="recall")
    assert score(stub, ("the cat", "the cat sat down"))[0].reward == pytest.approx(1 / 3)  # "the" is dropped
    missing = reward_service(rm_type="f1", reward_key="nope")
    result = score(missing, ("the cat", "the cat"))[0]
    assert result.error and "set --reward-key to one of them" in result.error_message


def test_list_reward_functions(reward_service, plugin):
    names = [f.name for f in reward_service().ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest()).functions]
    assert {"math", "dapo", "gsm8k", "multiple_choice"} <= set(names)


def test_hf_reward_model_plugin(reward_service, tmp_path):
    pytest.importorskip("torch")
    model = write_classifier(tmp_path / "rm")
    stub = reward_service(  # a minute for each worker's first item, which loads the model (seconds on a loaded machine)
        custom_rm_path="examples/reward_model/hf_classifier.py:score",
        custom_rm_args={"model_path": str(model)},
        rm_timeout_s=60.0,
    )
    results = score(stub, ("a good answer", ""), ("a bad answer", ""), ("a good answer", ""))
    assert not any(r.error for r in results), results
    assert results[0].reward == results[2].reward != results[1].reward  # deterministic, and it reads the text
    assert results[0].details["num_tokens"] > 0


def test_a_plugin_that_does_not_import_stops_the_service(service_process):
    proc = service_process("reward", "--port", "0", "--custom-rm-path", "no_such_module:score")
    assert proc.wait() == 1
    assert "--custom-rm-path: module 'no_such_module' was not found" in proc.log and "Traceback" not in proc.log
