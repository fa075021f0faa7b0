"""A custom reward function (`--custom-rm-path examples/custom_reward/my_reward.py:score`) for the demo's task, "the
larger of two digits": a format reward plus a correctness reward.

The reward service calls `score(args, sample)` in one of its worker processes for every response: `sample` has
`prompt`, `response`, `label`, `metadata` (a dict), `rm_type` and `item_id`; `args` is the service's config, whose
`custom_rm_args` holds `--custom-rm-args` (here `{"format_weight": 0.1}`, the default). It returns a dict: `score` is
the trained reward (`--reward-key`), the other numbers come back as the item's details and strings as its text
details. An exception fails only its item (reward `--reward-on-error`). `async def score` works the same way.
"""

import re

DIGIT = re.compile(r"[0-9]")


def score(args, sample) -> dict:
    """`format_weight` for answering with exactly one digit, the rest for the digit being the label."""
    format_weight = float(args.custom_rm_args.get("format_weight", 0.1))
    answer = sample.response.strip()
    digits = DIGIT.findall(answer)
    prediction = digits[-1] if digits else ""  # a longer answer is read by its last digit
    well_formed = DIGIT.fullmatch(answer) is not None
    correct = prediction == sample.label.strip()
    return {
        "score": format_weight * well_formed + (1.0 - format_weight) * correct,
        "acc": float(correct),
        "format": float(well_formed),
        "pred": prediction,
    }
