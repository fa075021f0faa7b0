"""The built-in reward types on answers written the way each dataset and paper documents them."""

import pytest

from services.reward.verifiers import (
    dapo,
    deepscaler,
    exact,
    f1,
    gsm8k,
    last_boxed,
    math,
    multiple_choice,
    score_builtin,
)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # fraction against decimal
        ("So \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal against fraction
        ("We get \\boxed{x=4}", "4", 1.0),  # an equation against its value
        ("\\boxed{10\\text{ cm}}", "10", 1.0),  # units in \text{}
        ("\\boxed{\\text{3}}", "3", 1.0),  # \text{} around a number
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),  # equal expressions, different forms
        ("The interval is \\boxed{(1, 2]}", "(1,2]", 1.0),
        ("\\boxed{5}", "4", 0.0),
        ("I don't know", "4", 0.0),
        ("", "4", 0.0),
        ("first \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),  # the last boxed answer counts
    ],
)
def test_math(response, label, reward):
    assert math(response, label, {}) == reward


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("<think>2+2 is 4</think>The answer is \\boxed{4}.", "4", 1.0),
        ("<think>...</think>\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),  # a boxed label
        ("The answer is \\boxed{4}.", "4", 0.0),  # no reasoning block: DeepScaleR gives 0
        ("<think>\\boxed{4}</think>The answer is 4.", "4", 0.0),  # the box must come after </think>
    ],
)
def test_deepscaler(response, label, reward):
    assert deepscaler(response, label, {}) == reward


def test_dapo_reads_the_last_answer_line():
    assert dapo("Let me compute.\nAnswer: 42", "42", {}) == {"score": 1.0, "acc": 1.0, "pred": "42"}
    assert dapo("Answer: 41\nWait, no.\nAnswer: $1,000$ dollars", "1000", {})["score"] == 1.0
    assert dapo("Answer: 7", "8", {}) == {"score": -1.0, "acc": 0.0, "pred": "7"}
    assert dapo("no answer line", "8", {})["pred"] == "[INVALID]"
    assert dapo("Answer: 12", "12.0", {})["acc"] == 1.0  # DAPO's labels are integers
    late = "Answer: 5\n" + "x" * 400  # only the last 300 characters are read
    assert dapo(late, "5", {})["score"] == -1.0


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "Natalia sold...\n#### 72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $18.00", "18", 1.0),
        ("The answer is 72", "72", 0.0),  # the #### format is required
        ("#### 71", "#### 72", 0.0),
    ],
)
def test_gsm8k(response, label, reward):
    assert gsm8k(response, label, {}) == reward


def test_exact_and_f1():
    assert exact("The Eiffel Tower.", "eiffel tower", {}) == 1.0
    assert exact("Eiffel", "eiffel tower", {}) == 0.0
    result = f1("the cat sat", "the cat sat on the mat", {})
    assert result["precision"] == 1.0 and result["recall"] == pytest.approx(2 / 4)
    assert result["score"] == pytest.approx(2 * 0.5 / 1.5)
    assert f1("dog", "cat", {})["score"] == 0.0


@pytest.mark.parametrize(
    ("response", "label", "choice"),
    [
        ("After comparing the options, the answer is (C).", "C", "C"),
        ("Answer: B", "(B)", "B"),
        ("Therefore \\boxed{D}", "D", "D"),
        ("I pick A", "C", "A"),
    ],
)
def test_multiple_choice(response, label, choice):
    result = multiple_choice(response, label, {})
    assert result["pred"] == choice and result["score"] == float(choice == label.strip("()"))


def test_boxed_prefix_extracts_first():
    assert score_builtin("boxed_exact", "Thinking about Paris... final: \\boxed{Paris}", "paris", {}) == 1.0
    assert score_builtin("boxed_exact", "Paris", "paris", {}) == 0.0  # no box: nothing to compare
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{{x}}") == "{x}"
    assert last_boxed("\\boxed{unclosed") is None


def test_random_is_zero_or_one():
    assert {score_builtin("random", "", "", {}) for _ in range(50)} == {0.0, 1.0}
