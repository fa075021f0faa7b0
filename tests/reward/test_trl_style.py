"""Reward functions written for TRL, through --custom-rm-path as they are: TRL's keyword arguments, a call for a
batch, and the demo's model trained with one."""

import json
from pathlib import Path

from services.reward.isolation import RewardSample
from services.reward.trl_style import is_trl_style, trl_kwargs
from services.train.demo import train_args

EXAMPLE = Path(__file__).parents[2] / "examples" / "custom_reward" / "trl_reward.py"


def test_a_trl_function_is_told_from_slimes_and_gets_trls_keywords():
    def slime(args, sample):
        return 1.0

    def accuracy(completions, label, **kwargs):
        return [float(c == x) for c, x in zip(completions, label, strict=True)]

    assert is_trl_style(accuracy) and not is_trl_style(slime) and not is_trl_style(len)
    samples = [RewardSample("1 + 1?", "2", "2", {"level": 1}), RewardSample("2 + 2?", "5", "4", {})]
    kwargs = trl_kwargs(samples)
    assert kwargs == {"prompts": ["1 + 1?", "2 + 2?"], "completions": ["2", "5"], "label": ["2", "4"],
                      "level": [1, None]}  # fmt: skip
    assert accuracy(**kwargs) == [1.0, 0.0]


def test_trls_documented_reward_len_trains_the_demos_model_unchanged(service_process, tmp_path):
    steps = 3
    run = service_process("train", *train_args(tmp_path, steps=steps), "--custom-rm-path", f"{EXAMPLE}:reward_len")
    assert run.wait(600) == 0, run.log[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "demo" / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(steps))
    for line in lines:  # -|20 - length|: every reward scored (none failed), each at most 0
        assert not line["metrics"].get("reward_failed") and line["metrics"]["reward"] < 0
