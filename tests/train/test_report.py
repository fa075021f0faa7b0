"""The launcher's step line: the trainer's log-probs against the engines' (train-rollout agreement) shown each step,
and a warning, once, when they differ by more than AGREEMENT_WARN on average."""

from services.train.report import AGREEMENT_WARN, Progress, summary_line


def line(step: int, difference: float) -> dict:
    metrics = {"reward": 0.5, "response_length": 12.0, "train_rollout_logprob_abs_diff": difference,
               "train_rollout_logprob_abs_diff_max": 4 * difference}  # fmt: skip
    return {"step": step, "metrics": metrics}


def test_the_step_line_shows_the_agreement_and_a_large_difference_warns_once():
    assert "logp diff 0.012" in summary_line(line(0, 0.012))
    progress = Progress(total=3, first=0)
    with progress.console.capture() as captured:
        for step, difference in enumerate((0.01, 2 * AGREEMENT_WARN, 3 * AGREEMENT_WARN)):
            progress.step(line(step, difference))
    text = captured.get()
    assert text.count("differ from the engines'") == 1 and "by 0.200 on average" in text
