"""What a finished prompt group must be: checked by the buffer's SubmitGroup and by a worker that completes its
training groups in the buffer's Redis itself (dataplane.completion, a lease with `submit_namespace`)."""

from services.common.errors import InvalidArgument
from slipstream import samples
from slipstream.v1 import common_pb2


def group_id_of(lease_id: str) -> str | None:
    group_id, sep, attempt = lease_id.rpartition("#")
    return group_id if sep and group_id and attempt.isdigit() else None


def leased_group_id(lease_id: str) -> str:
    """The group of a lease id a submit names; a clear error when it is not one LeasePrompts gave."""
    if (group_id := group_id_of(lease_id)) is None:
        raise InvalidArgument("lease_id", f"{lease_id!r} is not a lease id from LeasePrompts")
    return group_id


def num_tokens(group: common_pb2.PromptGroup) -> int:
    return sum(s.prompt_length + s.response_length for s in group.samples)


def min_version(group: common_pb2.PromptGroup) -> int:
    """The oldest weight version that produced any token of the group (from the samples' spans)."""
    versions = [int(span.version) for s in group.samples for span in s.weight_versions if span.version.isdigit()]
    return min(versions) if versions else group.min_weight_version


CHECKED_ARRAYS = ("tokens", "loss_mask", "rollout_logprobs")


def check_group(
    group: common_pb2.PromptGroup, expected: int | None, arrays_in_redis: bool, sizes: list[dict] | None = None
) -> None:
    """`expected` is the training group size; an evaluation may ask for any number of samples (at least one).
    Uploaded arrays come from a gateway, which checks what it generates; only arrays sent here are checked: in the
    group, or taken out of it already, given by their `sizes` (samples.take_sized_arrays)."""
    if expected is not None and len(group.samples) != expected:
        raise InvalidArgument(
            "group.samples", f"expected {expected} samples (--n-samples-per-prompt), got {len(group.samples)}"
        )
    if not group.samples:
        raise InvalidArgument("group.samples", "a group needs at least one sample")
    for i, sample in enumerate(group.samples):
        where = f"group.samples[{i}]"
        if sample.prompt_length < 0 or sample.response_length < 0:
            raise InvalidArgument(f"{where}.prompt_length", "prompt_length and response_length must be >= 0")
        if arrays_in_redis:
            if any(getattr(sample, name) for name in samples.ARRAYS):
                raise InvalidArgument(f"{where}.tokens", "with arrays_in_redis the arrays are uploaded, not sent")
            continue
        # Each read of a bytes field copies it out of the message: read each once.
        lengths = sizes[i] if sizes is not None else {name: len(getattr(sample, name)) for name in CHECKED_ARRAYS}
        token_bytes, logprob_bytes = lengths.get("tokens", 0), lengths.get("rollout_logprobs", 0)
        if token_bytes % 4 or logprob_bytes % 4:
            raise InvalidArgument(f"{where}.tokens", "tokens and rollout_logprobs hold 4-byte values (int32, float32)")
        tokens = token_bytes // 4
        if sample.prompt_length + sample.response_length != tokens:
            raise InvalidArgument(
                f"{where}.tokens",
                f"has {tokens} tokens but prompt_length + response_length = "
                f"{sample.prompt_length} + {sample.response_length}",
            )
        for name, size in (("loss_mask", lengths.get("loss_mask", 0)), ("rollout_logprobs", logprob_bytes // 4)):
            if size not in (0, sample.response_length):
                raise InvalidArgument(
                    f"{where}.{name}", f"has {size} entries; it needs one per response token ({sample.response_length})"
                )
