"""Evaluate: one pass over each eval set through the real engines and reward service, while a rollout runs."""

import time

import grpc
import pytest

from services.rollout.evaluation import pass_at_k
from slipstream.v1 import buffer_pb2, common_pb2, rollout_pb2
from tests.rollout.conftest import wait_completed


def test_pass_at_k_matches_the_unbiased_estimate():
    group = common_pb2.PromptGroup(samples=[common_pb2.Sample(reward=r) for r in (1, 0, 0, 1)])
    assert pass_at_k(group, 1) == pytest.approx(0.5)
    assert pass_at_k(group, 2) == pytest.approx(1 - 1 / 6)  # both failing samples drawn: 1 of C(4, 2) pairs
    assert pass_at_k(group, 4) == 1.0


def test_evaluate_runs_one_pass_per_call_beside_a_rollout(system):
    buffer, gateway, _ = system
    gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    for _ in range(2):  # every call is one whole pass over the 6 eval prompts
        reply = gateway.Evaluate(rollout_pb2.EvaluateRequest(n_samples_per_prompt=4, step=3), timeout=120)
        (result,) = reply.results
        assert result.dataset == "arith" and result.num_samples == 6 * 4
        assert 0 <= result.mean_reward <= 1
        assert {"pass@1", "pass@2", "pass@4", "response_length/mean", "truncated_ratio"} <= set(result.metrics)
        assert result.metrics["pass@1"] == pytest.approx(result.mean_reward)  # random rewards are 0 or 1
        assert result.metrics["pass@1"] <= result.metrics["pass@2"] <= result.metrics["pass@4"]
        assert 0 < result.metrics["response_length/mean"] <= 8
    state = wait_completed(buffer, 4)
    assert state.counters["eval_completed"] == 12 and state.num_leased_groups >= 0
    assert list(state.eval_datasets) == ["arith"]
    gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)


def test_evaluate_overrides_sampling_and_rejects_unknown_sets(system):
    _, gateway, _ = system
    overrides = common_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True)
    reply = gateway.Evaluate(rollout_pb2.EvaluateRequest(datasets=["arith"], sampling_params=overrides), timeout=120)
    (result,) = reply.results
    assert result.num_samples == 6  # the buffer's --n-samples-per-eval-prompt (1)
    assert result.metrics["response_length/max"] == result.metrics["response_length/min"] == 3
    assert result.metrics["truncated_ratio"] == 1.0
    with pytest.raises(grpc.RpcError) as info:
        gateway.Evaluate(rollout_pb2.EvaluateRequest(datasets=["aime"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown eval set(s) aime; the buffer has arith" in info.value.details()


def test_buffer_keeps_eval_groups_apart_from_training(system):
    buffer, gateway, _ = system
    gateway.Evaluate(rollout_pb2.EvaluateRequest(), timeout=120)
    state = buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10)
    assert state.counters["eval_completed"] == 6 and state.num_completed_groups == 0


def test_an_eval_config_gives_each_set_its_keys_samples_sampling_and_reward(make_system, tmp_path):
    """slime's --eval-config, read by the buffer (sets, keys, samples per prompt, reward type), the gateway (sampling,
    generate functions) and the reward service (it checks the reward types): the reward service scores with `exact`,
    but "short" asks for `random` (some rewards are 1) and "graded" for dapo's {score: ±1, acc: 0/1}, of which the
    gateway's --eval-reward-key takes `acc`; "renamed" has its prompts and labels under other keys than training's."""
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(f'{{"question": "What is {i} + 2?", "answer": "{i + 2}"}}\n' for i in range(5)))
    grader = tmp_path / "grader.py"  # answers the even prompts right and the odd ones wrong
    grader.write_text(
        "from services.rollout.generate import generate_group\n\n"
        "async def generate(ctx, group):\n"
        "    samples = await generate_group(ctx, group, resume=False)\n"
        "    for sample in samples:\n"
        "        sample.response_text = 'Answer: ' + (group.label if group.prompt_index % 2 == 0 else 'none')\n"
        "    return samples\n"
    )
    config = tmp_path / "eval.yaml"
    prompts = tmp_path / "prompts.jsonl"
    config.write_text(
        "eval:\n  defaults: {n_samples_per_eval_prompt: 2}\n  datasets:\n"
        f"    - {{name: short, path: '{prompts}@[0:6]', max_response_len: 2, rm_type: random, "
        "n_samples_per_eval_prompt: 4}\n"
        f"    - {{name: renamed, path: '{renamed}', input_key: question, label_key: answer}}\n"
        f"    - {{name: graded, path: '{prompts}@[0:4]', rm_type: dapo, n_samples_per_eval_prompt: 1, "
        f"custom_generate_function_path: '{grader}:generate'}}\n"
    )
    system = make_system(num_engines=1, buffer={"eval_prompt_data": [], "eval_config": str(config)},
                         reward={"rm_type": "exact", "eval_config": str(config)}, eval_config=str(config),
                         eval_reward_key="acc")  # fmt: skip
    results = {r.dataset: r for r in system.gateway.Evaluate(rollout_pb2.EvaluateRequest(), timeout=120).results}
    assert set(results) == {"short", "renamed", "graded"}
    assert results["short"].num_samples == 6 * 4 and results["short"].metrics["response_length/max"] <= 2
    assert results["short"].mean_reward > 0  # `random`: 24 draws of 0 or 1 (a plain number: no key to take)
    assert results["renamed"].num_samples == 5 * 2 and results["renamed"].metrics["response_length/max"] <= 8
    assert results["graded"].num_samples == 4 and results["graded"].mean_reward == 0.5  # score's mean would be 0


def test_an_evaluation_paused_by_a_weight_sync_still_covers_every_prompt(make_system):
    """A weight sync's `abort` pause sends an eval group back to the buffer with what it generated; the pass leases
    it again and finishes it. (It used to be left out: the pass reported the other prompts, and the groups left out
    made the next evaluation on their own — a real model's held-out accuracy read 0.000 on 3 of 256 prompts.)"""
    system = make_system(rollout_max_response_len=96, rollout_concurrency=8, buffer={"n_samples_per_eval_prompt": 4})
    pool = system.rollout.pool
    request = rollout_pb2.EvaluateRequest(sampling_params=common_pb2.SamplingParams(max_new_tokens=96,
                                                                                   ignore_eos=True))  # fmt: skip
    reply = system.gateway.Evaluate.future(request, timeout=180)
    deadline = time.monotonic() + 60
    while sum(e.outstanding for e in pool.engines.values()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # some tokens generated
    system.run(pool.pause("abort"))
    time.sleep(0.5)
    system.run(pool.resume())
    (result,) = reply.result().results
    assert result.num_samples == 6 * 4  # every prompt of the set, every sample
    assert result.metrics["response_length/min"] == 96  # the paused ones resumed where they stopped
