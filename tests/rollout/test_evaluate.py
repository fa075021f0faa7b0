"""Evaluate: one pass over each eval set through the real engines and reward service, while a rollout runs."""

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
