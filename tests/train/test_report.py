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


def test_a_slow_steps_rate_an_evaluations_failed_rewards_and_the_plot_say_what_they_are(tmp_path, monkeypatch):
    slow = {"step": 0, "metrics": {"reward": 0.5, "step_s": 40.0, "samples_per_s": 0.4}}
    assert "0.4 samples/s" in summary_line(slow)  # not "0 samples/s"
    progress = Progress(total=1, first=0)
    with progress.console.capture() as captured:
        progress.eval({"step": 0, "results": {"held_out": {"mean_reward": 0.0, "num_samples": 32, "reward_failed": 1}}})
    assert "held_out 0.000 (32 of 32 rewards failed)" in captured.get()
    import matplotlib.figure

    from services.train import report

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: saved.append(figure))
    steps = [{"step": i, "metrics": {"reward": 0.1 * i}} for i in range(3)]
    report.plot(tmp_path / "reward.png", steps, [], "demo: mean reward per step")
    ax = saved[0].axes[0]
    assert ax.get_title() == "demo: mean reward per step"
    assert all(tick == int(tick) for tick in ax.get_xticks())  # a short run's steps: whole ticks
