"""Built-in rule-based rewards (slime's rm_hub), as pure functions of (response, label, metadata).

Each returns a number or a dict of components (the trained one picked by --reward-key). Mathematical equivalence
is decided by the `math-verify` library; the extraction rules follow each dataset's documented answer format.
"""

import random
import re
import string
from collections import Counter
from collections.abc import Callable

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    matches = list(BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def math_equal(gold: str, prediction: str) -> bool:
    """Whether `prediction` states the same mathematical answer as `gold` (fractions, decimals, sets, intervals,
    `x = 4` against `4`, units and \\text{} around numbers), by math-verify."""
    from math_verify import parse, verify

    gold_parsed = parse(gold if "\\boxed" in gold or "$" in gold else f"${gold}$")
    if not gold_parsed:
        gold_parsed = parse(gold)
    return bool(gold_parsed) and verify(gold_parsed, parse(prediction))


def math(response: str, label: str, metadata: dict) -> float:
    """1 if the response's final answer (its last \\boxed{}, else the answer math-verify finds) equals the label."""
    boxed = last_boxed(response)
    return float(math_equal(label, response if boxed is None else f"\\boxed{{{boxed}}}"))


def deepscaler(response: str, label: str, metadata: dict) -> float:
    """DeepScaleR: only the text after the reasoning (`</think>`) counts, and it must box its answer."""
    if "</think>" not in response:
        return 0.0
    answer = last_boxed(response.split("</think>")[-1])
    if answer is None:
        return 0.0
    gold = last_boxed(label) or label
    return float(math_equal(gold, f"\\boxed{{{answer}}}"))


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_UNITS = re.compile(r"\\text\{\s*(?:[a-zA-Z ]+)\}|\\mathrm\{[^}]*\}|\^\\circ|\^\{\\circ\}|\\%|%")
_UNIT_WORDS = re.compile(
    r"(?i)\b(dollars?|cents?|units?|cm|mm|km|m|meters?|feet|foot|inches?|miles?|mph|hours?|minutes?|seconds?|"
    r"degrees?|points?|pounds?|grams?|kg|students?|people|ways|days?|years?|sq)\b"
)


def normalize_answer(text: str) -> str:
    """DAPO/Minerva-style normalization of a final answer: the right side of `=`, no $, \\text{}, units, spaces or
    thousands separators."""
    text = text.split("=")[-1]
    text = text.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    boxed = last_boxed(text)
    text = boxed if boxed is not None else text
    text = _UNITS.sub("", text)
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    text = _UNIT_WORDS.sub("", text)
    text = text.strip().rstrip(".").replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def dapo(response: str, label: str, metadata: dict) -> dict:
    """DAPO: the last `Answer:` line within the last 300 characters; +1 if it matches the label, else -1."""
    matches = _ANSWER_LINE.findall(response[-300:])
    prediction = normalize_answer(matches[-1]) if matches else "[INVALID]"
    gold = normalize_answer(label)
    with_number = re.fullmatch(r"-?\d+(\.0+)?", gold)
    gold = str(int(float(gold))) if with_number else gold
    correct = prediction == gold
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": prediction}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _gsm8k_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text.replace("$", ""))
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k(response: str, label: str, metadata: dict) -> float:
    """GSM8K: the number after the last `####` in the response (strict format) equals the label's number."""
    if "####" not in response:
        return 0.0
    prediction = _gsm8k_number(response.split("####")[-1])
    gold = _gsm8k_number(label.split("####")[-1])
    return float(prediction is not None and gold is not None and abs(prediction - gold) < 1e-6)


def _squad_tokens(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def exact(response: str, label: str, metadata: dict) -> float:
    """1 if the response equals the label after SQuAD normalization (case, punctuation, articles, spaces)."""
    return float(_squad_tokens(response) == _squad_tokens(label))


def f1(response: str, label: str, metadata: dict) -> dict:
    """Token F1 between response and label (SQuAD normalization), with precision and recall."""
    predicted, gold = _squad_tokens(response), _squad_tokens(label)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return {"score": 0.0, "precision": 0.0, "recall": 0.0}
    precision, recall = common / len(predicted), common / len(gold)
    return {"score": 2 * precision * recall / (precision + recall), "precision": precision, "recall": recall}


_CHOICE_PATTERNS = [
    re.compile(r"(?i)answer\s*(?:is|:)?\s*[:\s]*\(?([A-J])\)?(?![A-Za-z])"),
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"(?<![A-Za-z])([A-J])(?![A-Za-z])"),
]


def multiple_choice(response: str, label: str, metadata: dict) -> dict:
    """GPQA-style: the chosen letter (`Answer: C`, `\\boxed{C}`, `(C)`, or the last standalone letter A to J)."""
    gold = label.strip().strip("()").upper()[:1]
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            choice = found[-1].upper()
            return {"score": float(choice == gold), "pred": choice}
    return {"score": 0.0, "pred": ""}


_ANSWER_AFTER = re.compile(r"(?i)answer\s*:")


def final_answer(response: str, numeric: bool) -> str | None:
    """The answer a response states: what follows its last `Answer:` on that line (its last number when the expected
    answer is a number), else its last number; None when it has neither."""
    found = list(_ANSWER_AFTER.finditer(response))
    if found:
        text = response[found[-1].end() :].strip().split("\n")[0]
        numbers = _NUMBER.findall(text)
        if numeric and numbers:
            return numbers[-1].replace(",", "").rstrip(".")
        return text.strip().rstrip(".").strip("*$` ").rstrip(".")
    numbers = _NUMBER.findall(response)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def _whole_numbers(value):
    """Metadata as the task wrote it: a protobuf Struct carries every number as a float (3 → 3.0)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def reasoning_gym(response: str, label: str, metadata: dict) -> dict:
    """reasoning-gym's own checker of the task in `metadata.source_dataset`, on the response's final answer (its last
    `Answer:` line, else its last number); raises for a problem the checker cannot score."""
    import reasoning_gym as rg

    metadata = _whole_numbers(metadata)
    task = metadata.get("source_dataset")
    if not task:
        raise ValueError("metadata has no source_dataset: write the prompts with `slipstream reasoning-gym`")
    numeric = _NUMBER.fullmatch(label.strip()) is not None
    answer = final_answer(response, numeric)
    entry = {"question": metadata.get("question", ""), "answer": label, "metadata": metadata}
    score = float(rg.get_score_answer_fn(task)(answer, entry))
    return {"score": score, "acc": float(score == 1.0), "pred": answer or ""}


def random_reward(response: str, label: str, metadata: dict) -> float:
    """0 or 1 at random (a baseline and a smoke test)."""
    return float(random.randint(0, 1))


BUILT_IN: dict[str, Callable] = {
    "math": math,
    "deepscaler": deepscaler,
    "dapo": dapo,
    "gsm8k": gsm8k,
    "exact": exact,
    "f1": f1,
    "multiple_choice": multiple_choice,
    "random": random_reward,
    "reasoning_gym": reasoning_gym,
}
# What a verifier imports (a second of CPU for math-verify's sympy and parsers), warmed in each reward worker before
# its first item when it is one of the service's types: --rm-type (else the default) and the eval sets'.
IMPORTS = {"math": "math_verify", "deepscaler": "math_verify", "reasoning_gym": "reasoning_gym"}
NEEDS_LABEL = set(BUILT_IN) - {"random"}
REMOTE = ("remote_rm", "remote_grpc")  # reward models elsewhere: --rm-url's (HTTP) and --rm-grpc-addr's
DEFAULT_RM_TYPE = "math"  # where neither the item, the request nor --rm-type names one
RM_TYPES = (*BUILT_IN, *REMOTE)  # the valid rm_type values, besides the built-ins' boxed_ forms


def is_known(rm_type: str) -> bool:
    """Whether `rm_type` names a reward: a built-in, its `boxed_` form (\\boxed{} extracted first) or a remote one."""
    return rm_type.removeprefix("boxed_") in BUILT_IN or rm_type in REMOTE


def resolve(rm_type: str) -> tuple[Callable, bool]:
    """The verifier for `rm_type` and whether the response's \\boxed{} content is extracted first (`boxed_` prefix).
    Raises KeyError for an unknown type."""
    boxed = rm_type.startswith("boxed_")
    return BUILT_IN[rm_type.removeprefix("boxed_")], boxed


def imports_of(rm_types: set[str]) -> tuple[str, ...]:
    """The modules the verifiers of `rm_types` (or their boxed_ forms) import, to warm in the workers."""
    names = {t.removeprefix("boxed_") for t in rm_types}
    return tuple(sorted({IMPORTS[name] for name in names if name in IMPORTS}))


def score_builtin(rm_type: str, response: str, label: str, metadata: dict) -> float | dict:
    verifier, boxed = resolve(rm_type)
    if boxed:
        response = last_boxed(response) or ""
    return verifier(response, label, metadata)
