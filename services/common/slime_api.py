"""What functions written for slime's extension points receive: `Sample`, with slime's field names, and `args`, the
run's settings as a namespace under slime's flag names. The trainer's hooks (loss, advantages, TIS, reward
post-processing, sample conversion) and the gateway's (rollout and rollout-log functions) hand these to user code,
so a function written against slime's documented signatures runs here unchanged (docs/plugins.md)."""

import argparse
import enum
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from services.common.config import flat_settings
from slipstream import samples as arrays
from slipstream.v1 import common_pb2


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


TO_PROTO = {
    Status.PENDING: common_pb2.SAMPLE_STATUS_PENDING,
    Status.COMPLETED: common_pb2.SAMPLE_STATUS_COMPLETED,
    Status.TRUNCATED: common_pb2.SAMPLE_STATUS_TRUNCATED,
    Status.ABORTED: common_pb2.SAMPLE_STATUS_ABORTED,
    Status.FAILED: common_pb2.SAMPLE_STATUS_FAILED,
}
FROM_PROTO = {value: key for key, value in TO_PROTO.items()}


@dataclass
class Sample:
    """One generated response and its prompt, as slime's `slime.utils.types.Sample` (the fields its functions read)."""

    Status = Status

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    train_metadata: dict | None = None


def metadata_of(message: common_pb2.PromptGroup | common_pb2.Sample) -> dict:
    """A group's or a sample's metadata as a dict (empty when it has none)."""
    return json_format.MessageToDict(message.metadata) if message.HasField("metadata") else {}


def samples_of(groups: list[common_pb2.PromptGroup]) -> list[Sample]:
    """Every sample of `groups`, in order, with its group's prompt, label and metadata."""
    out = []
    for g, group in enumerate(groups):
        metadata = metadata_of(group)
        for sample in group.samples:
            extra = metadata_of(sample)
            out.append(
                Sample(
                    group_index=g,
                    index=len(out),
                    prompt=group.prompt_text,
                    tokens=arrays.decode_tokens(sample.tokens).tolist(),
                    response=sample.response_text,
                    response_length=sample.response_length,
                    label=group.label,
                    reward=sample.reward,
                    loss_mask=arrays.decode_mask(sample.loss_mask).tolist() if sample.loss_mask else None,
                    weight_versions=[span.version for span in sample.weight_versions],
                    rollout_log_probs=arrays.decode_logprobs(sample.rollout_logprobs).tolist() or None,
                    status=FROM_PROTO.get(sample.status, Status.COMPLETED),
                    metadata={**metadata, **extra},
                )
            )
    return out


def args_of(*configs, **extra) -> argparse.Namespace:
    """The settings of `configs` (pydantic models; the first one wins on a shared name) as slime's `args`."""
    merged: dict[str, Any] = {}
    for config in reversed(configs):
        merged.update(flat_settings(config))
    return argparse.Namespace(**merged, **extra)
