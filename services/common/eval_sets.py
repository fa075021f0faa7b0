"""slime's multi-task evaluation file (`--eval-config`, slime's YAML): an entry per eval set, under `eval:` (or at the
root), with `defaults` for every set:

    eval:
      defaults: {max_response_len: 16384, top_p: 0.7}
      datasets:
        - {name: aime, path: aime.jsonl, rm_type: deepscaler, n_samples_per_eval_prompt: 16}
        - {name: gsm8k, path: gsm8k.parquet@[0:500], input_key: question, label_key: answer}

Each setting comes from the set's entry, else `defaults`, else the --eval-* flag, else the training setting, as in
slime. The buffer takes what makes the prompts (path, keys, chat template, samples per prompt, the reward type and
metadata_overrides as the prompts' metadata), the gateway what makes the responses (sampling, a generate function) and
the reward service checks the reward types. Each takes them as one `EvalSets` (`read`), and a process reads a file
once however many of its configs name it (`slipstream train` builds all three)."""

import difflib
import functools
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, Field, ValidationError

from services.common.config import StrictModel

# slime's keys that have no meaning here, and why.
UNSUPPORTED = {
    "custom_rm_path": "the reward service's --custom-rm-path scores every set; pick a set's reward with rm_type",
    "multimodal_keys": "prompts are text",
    "app_service": "generation goes through the gateway's engines",
    "message_processor": "not supported",
    "reward_model": "pick a set's reward with rm_type",
    "remote_environment": "not supported",
    "eval_task_timeout": "the gateway's --request-timeout-s bounds every request",
    "min_eval_samples": "every prompt of a set is evaluated",
    "eval_early_stop_remaining": "every prompt of a set is evaluated",
    "eval_early_stop_idle_timeout": "every prompt of a set is evaluated",
}
# The settings the gateway samples with, by their names in the file → SGLang's.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_response_len": "max_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "min_new_tokens": "min_new_tokens",
    "repetition_penalty": "repetition_penalty",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
}


class EvalSet(StrictModel):
    """One eval set, by slime's names; unset settings take the --eval-* flags', then the training ones."""

    model_config = ConfigDict(frozen=True)  # read once, shared by the configs of a process

    name: str = Field(pattern=r"^[^:]+$")
    """The set's name in results (`eval/<name>`) and in the buffer."""
    path: str
    """A .jsonl or .parquet file, optionally sliced by rows as path@[a:b]."""
    input_key: str | None = None
    """Row field of the prompt (buffer)."""
    label_key: str | None = None
    """Row field of the label (buffer)."""
    tool_key: str | None = None
    """Row field of the tool specs (buffer)."""
    metadata_key: str | None = None
    """Row field of the metadata (buffer)."""
    apply_chat_template: bool | None = None
    """Format prompts with the tokenizer's chat template (buffer)."""
    apply_chat_template_kwargs: dict | None = None
    """Arguments of the chat template (buffer)."""
    rm_type: str | None = None
    """Reward type of the set: put in every prompt's metadata, where the reward service looks first."""
    metadata_overrides: dict[str, Any] = {}
    """Added to every prompt's metadata (buffer)."""
    n_samples_per_eval_prompt: int | None = Field(None, ge=1)
    """Responses per prompt (buffer)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature (gateway)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Top-p (gateway)."""
    top_k: int | None = Field(None, ge=-1)
    """Top-k, -1 off (gateway)."""
    max_response_len: int | None = Field(None, ge=1)
    """Most new tokens of a response (gateway)."""
    stop: list[str] | None = None
    """Stop strings (gateway)."""
    stop_token_ids: list[int] | None = None
    """Stop token ids (gateway)."""
    min_new_tokens: int | None = Field(None, ge=0)
    """Fewest new tokens of a response (gateway)."""
    repetition_penalty: float | None = Field(None, ge=0, le=2)
    """SGLang's repetition_penalty (gateway)."""
    skip_special_tokens: bool | None = None
    """SGLang's skip_special_tokens for the response text (gateway)."""
    no_stop_trim: bool | None = None
    """SGLang's no_stop_trim: keep the stop string in the response text (gateway)."""
    custom_generate_function_path: str | None = None
    """The set's own generate function, as --custom-generate-function-path (gateway)."""

    def metadata(self) -> dict[str, Any]:
        """What every prompt of the set carries in its metadata (the reward service reads `rm_type` there)."""
        return {**({"rm_type": self.rm_type} if self.rm_type else {}), **self.metadata_overrides}

    def sampling(self) -> dict[str, Any]:
        """The set's own sampling settings, by SGLang's names."""
        return {SAMPLING[k]: v for k, v in self.model_dump(include=set(SAMPLING)).items() if v is not None}


class EvalSets(tuple):
    """A run's eval sets in their order (a tuple of `EvalSet`), found by name with `get`."""

    def get(self, name: str) -> EvalSet | None:
        return next((s for s in self if s.name == name), None)

    def rm_types(self) -> dict[str, str]:
        """The reward type of each set that names one, by set name."""
        return {s.name: s.rm_type for s in self if s.rm_type}


def read(eval_config: Path | None, pairs: tuple[str, ...] = ()) -> EvalSets:
    """The eval sets of --eval-config, else of --eval-prompt-data's name/path `pairs` (sets with no settings of their
    own); a file is read once a process while it is unchanged. A ValueError names the file, the set and the key."""
    if eval_config is None:
        return EvalSets(EvalSet(name=name, path=path) for name, path in zip(pairs[::2], pairs[1::2], strict=True))
    try:
        stat = Path(eval_config).stat()
    except OSError as e:
        raise ValueError(f"--eval-config {eval_config}: {e}") from None
    return _read(Path(eval_config).resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read(path: Path, mtime_ns: int, size: int) -> EvalSets:
    return EvalSets(load(path))


def load(path: Path) -> list[EvalSet]:
    """The eval sets of a slime eval config; a ValueError names the file, the set and the key at fault."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--eval-config {path}: {e}") from None
    root = document.get("eval", document) if isinstance(document, dict) else None
    if not isinstance(root, dict):
        raise ValueError(f"--eval-config {path}: expected a mapping with `datasets` (under `eval:` or at the root)")
    defaults, entries = root.get("defaults") or {}, root.get("datasets")
    if isinstance(entries, dict):  # slime also takes {name: settings}
        entries = [{"name": name, **(settings or {})} for name, settings in entries.items()]
    if not entries or not isinstance(entries, list) or not isinstance(defaults, dict):
        raise ValueError(f"--eval-config {path}: `datasets` must list at least one set, `defaults` be a mapping")
    _check_keys(path, "defaults", defaults, allowed=set(EvalSet.model_fields) - {"name", "path"})
    sets = []
    for entry in entries:
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError(f"--eval-config {path}: every entry of `datasets` needs a name, got {entry!r}")
        where = f"set {entry['name']!r}"
        _check_keys(path, where, entry, allowed=set(EvalSet.model_fields))
        try:
            sets.append(EvalSet(**{**defaults, **entry}))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"--eval-config {path}: {where}: {problems}") from None
    names = [s.name for s in sets]
    if len(set(names)) != len(names) or "train" in names:
        raise ValueError(f"--eval-config {path}: set names must be unique and not 'train', got {names}")
    return sets


def _check_keys(path: Path, where: str, mapping: dict, allowed: set[str]) -> None:
    for key in mapping:
        if key in UNSUPPORTED:
            raise ValueError(f"--eval-config {path}: {where}: {key} is not supported here ({UNSUPPORTED[key]})")
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the keys are {', '.join(sorted(allowed))}"
            raise ValueError(f"--eval-config {path}: {where}: unknown key {key!r}; {hint}")
