"""Reward functions written for TRL's GRPOTrainer, taken through --custom-rm-path as they are: `def reward(completions,
**kwargs) -> list[float]`, called once for a batch (here: every item of a Score call, a prompt group) with keyword
arguments as TRL gives them: `prompts` and `completions` (strings), and the dataset's other columns, one list each:
`label` (the column --label-key names) and each key of the sample's metadata (--metadata-key). A None (TRL: this
function does not score that completion) is a failed reward, scored --reward-on-error."""

import inspect


def is_trl_style(function) -> bool:
    """Whether `function` takes TRL's keywords (a `completions` parameter) rather than slime's (args, sample)."""
    try:
        return "completions" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or an extension's callable: slime's form
        return False


def trl_kwargs(samples: list) -> dict[str, list]:
    """The keyword arguments of one call for `samples` (isolation.RewardSample)."""
    columns = {"label": [s.label for s in samples]}
    for key in sorted({key for s in samples for key in s.metadata}):
        columns.setdefault(key, [s.metadata.get(key) for s in samples])
    return {"prompts": [s.prompt for s in samples], "completions": [s.response for s in samples], **columns}
