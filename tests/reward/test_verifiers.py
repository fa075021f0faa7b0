"""The built-in reward types on answers written the way each dataset and paper documents them."""

import pytest

from services.reward.verifiers import (
    dapo,
    deepscaler,
    exact,
    f1,
    final_answer,
    gsm8k,
    imports_of,
    last_boxed,
    math,
    multiple_choice,
    reasoning_gym,
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


@pytest.mark.parametrize(
    ("response", "numeric", "answer"),
    [
        ("5 - 3 = 2\nAnswer: 2", True, "2"),
        ("Answer: 5 - 3 = 2.", True, "2"),  # a number expected: the line's last number
        ("The result is -1,204.", True, "-1204"),  # no Answer: the last number
        ("Answer: **Paris**.", False, "Paris"),
        ("Answer: 7\nAnswer: 8", True, "8"),  # the last Answer: line
        ("no idea", True, None),
    ],
)
def test_the_final_answer_is_the_last_answer_line_else_the_last_number(response, numeric, answer):
    assert final_answer(response, numeric) == answer


def test_reasoning_gym_scores_with_the_tasks_own_checker():
    """Metadata as the reward service hands it over (a protobuf Struct: every number a float) reaches the checker as
    the task wrote it; a problem without its task fails the item (counted), it does not score 0."""
    pytest.importorskip("reasoning_gym")
    from services.buffer.reasoning_gym import problems, row

    entry = problems("chain_sum", {"min_terms": 3, "max_terms": 3}, seed=5, size=1)[0]
    prompt = row(entry)
    metadata = {k: float(v) if isinstance(v, int) else v for k, v in prompt["metadata"].items()}
    right = f"Let me add.\nAnswer: {entry['answer']}"
    assert reasoning_gym(right, prompt["label"], metadata) == {"score": 1.0, "acc": 1.0, "pred": entry["answer"]}
    assert reasoning_gym("Answer: 123456789", prompt["label"], metadata)["acc"] == 0.0
    with pytest.raises(ValueError, match="metadata has no source_dataset: write the prompts with"):
        reasoning_gym(right, prompt["label"], {})


def test_the_workers_warm_the_libraries_of_the_types_set():
    assert imports_of({"math", "exact"}) == ("math_verify",)
    assert imports_of({"boxed_deepscaler", "reasoning_gym"}) == ("math_verify", "reasoning_gym")
    assert imports_of({"exact", "f1", "remote_rm"}) == ()
