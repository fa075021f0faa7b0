"""Turns dataset rows into prompt groups: picks the prompt, label, metadata and tools by key, applies the chat
template and tokenizes, so that rollout is token-in/token-out. Runs in the data worker processes.
"""

import json
import threading
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from services.buffer.config import BufferConfig
from services.buffer.datasets import DatasetError, RawRow, parse_json_row
from services.common.eval_sets import EvalSet
from slipstream import samples
from slipstream.v1 import common_pb2


@dataclass(frozen=True)
class RowSpec:
    """How rows become prompts (picklable: it travels to the data workers)."""

    tokenizer_path: str
    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str = "metadata"
    tool_key: str | None = None
    apply_chat_template: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    max_prompt_len: int | None = None
    skip_invalid_rows: bool = False
    metadata: dict = field(default_factory=dict)  # added to every prompt's metadata (an eval set's rm_type, ...)
    flags: str = "--"  # the flags that set the fields above, named in errors: "--eval-" for an eval set's


@dataclass(frozen=True)
class Skipped:
    """A row that yields no prompt, and why (counted under `reason`)."""

    reason: str  # "invalid_row" or "prompt_too_long"
    message: str


def row_spec(config: BufferConfig) -> RowSpec:
    return RowSpec(
        tokenizer_path=config.hf_checkpoint or "",
        input_key=config.input_key,
        label_key=config.label_key,
        metadata_key=config.metadata_key,
        tool_key=config.tool_key,
        apply_chat_template=config.apply_chat_template,
        chat_template_kwargs=config.apply_chat_template_kwargs,
        max_prompt_len=config.rollout_max_prompt_len,
        skip_invalid_rows=config.skip_invalid_rows,
    )


def eval_row_spec(config: BufferConfig, eval_set: EvalSet) -> RowSpec:
    """An eval set's own keys, chat template and metadata, else the --eval-* flags', else the training ones; its
    prompt length bound is --eval-max-prompt-len alone, as in slime."""
    own = {
        "input_key": eval_set.input_key or config.eval_input_key,
        "label_key": eval_set.label_key or config.eval_label_key,
        "tool_key": eval_set.tool_key or config.eval_tool_key,
        "metadata_key": eval_set.metadata_key,
        "apply_chat_template": eval_set.apply_chat_template,
        "chat_template_kwargs": eval_set.apply_chat_template_kwargs,
    }
    own = {k: v for k, v in own.items() if v is not None}
    own.update(max_prompt_len=config.eval_max_prompt_len, metadata=eval_set.metadata(), flags="--eval-")
    return replace(row_spec(config), **own)


_LOAD_LOCK = threading.Lock()


def load_tokenizer(path: str):
    # transformers' lazy imports are not safe to race from several threads.
    with _LOAD_LOCK:
        return _load_tokenizer(path)


@cache
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prepare_rows(rows: list[RawRow], spec: RowSpec) -> list[bytes | Skipped]:
    """Each row as serialized `PromptGroup` bytes (no id yet), or `Skipped`. Raises DatasetError for a bad row
    unless `spec.skip_invalid_rows`."""
    results: list[bytes | Skipped] = []
    for raw in rows:
        try:
            group = prompt_group(raw, spec)
        except DatasetError as e:
            if not spec.skip_invalid_rows:
                raise
            results.append(Skipped("invalid_row", str(e)))
            continue
        num_tokens = samples.num_tokens(group.prompt_tokens)
        if spec.max_prompt_len is not None and num_tokens > spec.max_prompt_len:
            bound = "--eval-max-prompt-len" if spec.flags == "--eval-" else "--rollout-max-prompt-len"
            message = f"{raw.where}: {num_tokens} prompt tokens > {bound}"
            results.append(Skipped("prompt_too_long", message))
            continue
        results.append(group.SerializeToString())
    return results


def check_rows(rows: list[RawRow], spec: RowSpec) -> int:
    """Checks every row's fields without tokenizing (a dataset read at start-up fails fast); returns how many rows
    are invalid, or raises DatasetError for the first one unless `spec.skip_invalid_rows`."""
    invalid = 0
    for raw in rows:
        try:
            _row_fields(raw, spec)
        except DatasetError:
            if not spec.skip_invalid_rows:
                raise
            invalid += 1
    return invalid


def _row_fields(raw: RawRow, spec: RowSpec) -> tuple[Any, str, dict | None, list | None]:
    """(prompt, label, metadata, tools) of a row, each checked."""
    row = parse_json_row(raw)
    prompt = _field(row, spec.input_key, raw, f"{spec.flags}input-key")
    is_messages = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)
    if not isinstance(prompt, str) and not is_messages:
        raise DatasetError(
            f'{raw.where}: field "{spec.input_key}" must be a string or a list of chat messages '
            f"({{role, content}}), not {type(prompt).__name__}"
        )
    if is_messages and not spec.apply_chat_template:
        raise DatasetError(f"{raw.where}: the prompt is a list of chat messages; pass --apply-chat-template")
    label = ""
    if spec.label_key:
        value = _field(row, spec.label_key, raw, f"{spec.flags}label-key")
        label = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    metadata = _json_field(row.get(spec.metadata_key), raw, spec.metadata_key, dict)
    tools = _json_field(row.get(spec.tool_key), raw, spec.tool_key, list) if spec.tool_key else None
    return prompt, label, metadata, tools


def prompt_group(raw: RawRow, spec: RowSpec) -> common_pb2.PromptGroup:
    prompt, label, metadata, tools = _row_fields(raw, spec)
    group = common_pb2.PromptGroup(prompt_index=raw.row, label=label)
    if metadata or spec.metadata:
        group.metadata.update({**(metadata or {}), **spec.metadata})
    if tools:
        group.tools_json = json.dumps(tools, ensure_ascii=False)
    text = _prompt_text(prompt, tools, spec)
    group.prompt_text = text
    group.prompt_tokens = samples.encode_tokens(
        load_tokenizer(spec.tokenizer_path).encode(text, add_special_tokens=False)
    )
    return group


def _prompt_text(prompt: Any, tools: list | None, spec: RowSpec) -> str:
    if not spec.apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    tokenizer = load_tokenizer(spec.tokenizer_path)
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **spec.chat_template_kwargs
    )


def _field(row: dict, key: str, raw: RawRow, flag: str) -> Any:
    if key not in row or row[key] is None:
        present = ", ".join(sorted(map(str, row))) or "none"
        also = " (or the set's own key in --eval-config)" if flag.startswith("--eval-") else ""
        raise DatasetError(f'{raw.where}: field "{key}" missing (keys present: {present}); pass {flag} <key>{also}')
    return row[key]


def _json_field(value: Any, raw: RawRow, key: str, kind: type) -> Any:
    """Metadata and tools may be stored as JSON strings (as Parquet often does) or as values."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DatasetError(f'{raw.where}: field "{key}" is a string that is not valid JSON') from None
    if not isinstance(value, kind):
        raise DatasetError(f'{raw.where}: field "{key}" must be a JSON {kind.__name__}, not {type(value).__name__}')
    return value
