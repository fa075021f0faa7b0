"""examples/custom_reward: its `score` loaded and called as a reward worker does (`run_custom`, through the plugin
loader), its answer turned into a reward as the service does, on answers of the demo's task."""

from pathlib import Path

import pytest

from services.reward.config import RewardConfig
from services.reward.core import Scorer
from services.reward.isolation import RewardSample, run_custom

PATH = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_reward' / 'my_reward.py'}:score"


def _reward(response: str, label: str = "7", **custom_rm_args):
    config = RewardConfig(custom_rm_path=PATH, custom_rm_args=custom_rm_args, num_workers=1)
    sample = RewardSample(prompt="3 7", response=response, label=label, item_id="0")
    return Scorer(config, pool=None)._result(sample, run_custom(PATH, config, sample))


@pytest.mark.parametrize(
    ("response", "reward", "acc", "well_formed"),
    [
        ("7", 1.0, 1.0, 1.0),  # right, one digit
        (" 7\n", 1.0, 1.0, 1.0),
        ("3", 0.1, 0.0, 1.0),  # wrong, but the format is right
        ("it is 7", 0.9, 1.0, 0.0),  # right, in a longer answer
        ("user", 0.0, 0.0, 0.0),  # no digit: neither
        ("", 0.0, 0.0, 0.0),  # the end-of-turn token alone (special tokens are skipped)
    ],
)
def test_scores_the_demo_task(response, reward, acc, well_formed):
    result = _reward(response)
    assert not result.error, result.error_message
    assert result.reward == pytest.approx(reward)
    assert result.details["acc"] == acc and result.details["format"] == well_formed
    assert "score" in result.details and "pred" in result.text_details


def test_format_weight_from_custom_rm_args():
    assert _reward("3", format_weight=0.5).reward == pytest.approx(0.5)
    assert _reward("7", format_weight=0.5).reward == pytest.approx(1.0)
    assert _reward("it is 7", format_weight=0.0).reward == pytest.approx(1.0)
