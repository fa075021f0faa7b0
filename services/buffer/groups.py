"""What a finished prompt group must be, and how it is completed: shared by the buffer's SubmitGroup and a worker that
completes its training groups in the buffer's Redis itself (a lease with `submit_namespace`, docs/buffer.md)."""

from services.buffer.store import BufferStore, Completion
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from slipstream import samples
from slipstream.v1 import buffer_pb2, common_pb2


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


def completion(lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> Completion:
    """A finished training group as a worker completes it in Redis itself, checked as SubmitGroup checks it. Takes
    the arrays out of `group`."""
    group_id = leased_group_id(lease.lease_id)
    arrays, sizes = samples.take_sized_arrays(group)  # checked once taken out: each array is copied once
    check_group(group, group.n_samples or None, arrays_in_redis=False, sizes=sizes)
    group.group_id, group.min_weight_version = group_id, min_version(group)
    return Completion(lease.lease_id, arrays, group.SerializeToString(), group.min_weight_version, num_tokens(group))


def completed_now(store: BufferStore, lease_id: str, result: str) -> bool:
    """What the submit script answered for a worker's group: True when the group was completed now, False when it had
    been already; raises for an unknown lease or a refusal."""
    if result == "unknown":
        raise NotFound(f"lease {lease_id!r} is unknown to the run under {store.ns!r}")
    if result not in ("accepted", "duplicate"):
        raise FailedPrecondition(f"the buffer's submit of lease {lease_id!r} answered {result!r}")
    return result == "accepted"


async def complete_in_redis(store: BufferStore, lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> bool:
    """A worker's submit of a finished training group without the buffer in between: checked as SubmitGroup checks
    it, then its arrays and the buffer's submit transition in one round trip to Redis (store.complete). The lease
    must have a `submit_namespace` (the buffer runs no dynamic-sampling filter, which needs the group). Takes the
    arrays out of `group`. True when the group was completed now, False when it had been already. A gateway completes
    the groups finished together in one call (services/rollout/submits.py)."""
    (result,) = await store.complete([completion(lease, group)])
    return completed_now(store, lease.lease_id, result)
