"""The process group that carries weights from the trainer (rank 0) to the engines, created the way SGLang creates
it (SGLang's `init_custom_process_group`, docs/sglang_api.md "Weight updates"), so both ends of a rendezvous agree.

It is a group outside torch's default one: the trainer has its own default group (its data/tensor parallel ranks)
and each engine may have another, so the weight group is built from its own TCP rendezvous, with the group name as
the store prefix.
"""

import logging
import os
import time
from collections.abc import Iterable
from datetime import timedelta
from urllib.parse import urlparse

import torch
from torch.distributed import distributed_c10d as c10d

log = logging.getLogger(__name__)

# What SGLang's server sets for itself (`_set_envs_and_config`) when the environment does not say otherwise. NCCL reads
# them once, when a process makes its first communicator, and both ends of a peer-to-peer link must agree: a trainer
# with cuMem buffers and an engine without fail the first broadcast ("Cuda failure 'invalid argument'" in p2p.cc).
NCCL_SETTINGS = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def apply_nccl_settings(environ: dict | None = None) -> dict:
    """Gives `environ` (this process's by default, before its first NCCL communicator) the weight group's NCCL
    settings where it has none, as SGLang does; warns of a value set otherwise, which every member must share."""
    environ = os.environ if environ is None else environ
    for name, value in NCCL_SETTINGS.items():
        environ.setdefault(name, value)
        if environ[name] != value:
            log.warning(
                "%s=%s is set; SGLang's engines use %s unless their environment says the same",
                name,
                environ[name],
                value,
            )
    return environ


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | None = None,
    collective_timeout: timedelta | None = None,
    listen_fd: int | None = None,
):
    """Joins (rank 0 hosts the TCP store) and returns the process group `group_name`; blocks until all ranks joined,
    for at most `timeout`. `collective_timeout` (default `timeout`) is torch's own deadline for each collective.
    `listen_fd`: rank 0's socket, bound to the port of `init_method` and listening, which the store takes over (and
    closes)."""
    timeout = timeout or c10d.default_pg_timeout
    # The store is built here rather than by c10d.rendezvous, which under torchrun would join torchrun's own store.
    address = urlparse(init_method)
    store = torch.distributed.TCPStore(
        address.hostname, address.port, world_size, rank == 0, timeout, master_listen_fd=listen_fd
    )
    store = c10d.PrefixStore(group_name, store)
    # A default group bound to a GPU (the trainer's) would make NCCL split this group from it, leaving out the
    # engines: the group is built as if there were none.
    default = c10d._world.default_pg
    bound = default.bound_device_id if default is not None else None
    if bound is not None:
        default.bound_device_id = None
    try:
        group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=group_name,
            timeout=collective_timeout or timeout,
            device_id=None,
        )
    finally:
        if bound is not None:
            default.bound_device_id = bound
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


_aborted: list[tuple[float, object]] = []  # (when its transfers have surely ended, gloo group): see abort_group


def abort_group(group, linger_s: float | None = None) -> None:
    """Ends `group` without waiting for its unfinished collectives, which may never finish (a member died or stalled):
    NCCL's abort ends their kernels at once. gloo cannot interrupt a transfer: it ends at the group's timeout
    (`linger_s`, by default torch's) or when the peer's socket closes, so the group is kept referenced until then
    (dropping it would wait in its destructor), and let go after (its sockets and store with it)."""
    now = time.monotonic()
    _aborted[:] = [(until, kept) for until, kept in _aborted if until > now]
    gloo = _is_gloo(group)
    try:
        c10d._abort_process_group(group)
    except (RuntimeError, ValueError) as e:  # already aborted, or it broke before: nothing left to end
        log.debug("aborting the weight group: %s", e)
    if gloo:
        linger = c10d.default_pg_timeout.total_seconds() if linger_s is None else linger_s
        _aborted.append((now + linger, group))


def destroy_group(group) -> None:
    """Destroys `group` unless it was aborted already (a watchdog ended its sync; abort_group keeps it referenced)."""
    if group in c10d._world.pg_map:
        torch.distributed.destroy_process_group(group)


def end_group(group, in_flight: bool, linger_s: float | None = None) -> None:
    """Ends `group`: a gloo group with no collective in flight is destroyed at once, with its sockets and store (an
    aborted one would hold them for `linger_s`); any other is aborted (abort_group). One aborted already (a watchdog
    ended its sync) is left as abort_group keeps it."""
    if group not in c10d._world.pg_map:
        return
    if not in_flight and _is_gloo(group):
        destroy_group(group)
    else:
        abort_group(group, linger_s)


def wait_for(handles: list, cancelled, deadline: float, poll_s: float = 0.0001) -> None:
    """Waits for a receive's broadcasts without blocking on them, so that a cancel (`cancelled`, an Event: the group
    was destroyed) or the deadline (monotonic) can end the wait; the stream waits for them once they completed."""
    for handle in handles:
        while not handle.is_completed():
            if cancelled.is_set():
                raise RuntimeError("the weight update group was destroyed while receiving")
            if time.monotonic() > deadline:
                raise RuntimeError("no broadcast arrived before the receive deadline (--weight-update-timeout-s)")
            time.sleep(poll_s)
        handle.wait()


def group_settings(body: dict) -> tuple[str, str, int, int, str]:
    """(backend, init method, world size, rank, group name) of an /init_weights_update_group body (SGLang's fields);
    KeyError, ValueError or TypeError naming a bad field."""
    rank = int(body["rank_offset"])
    init = f"tcp://{body['master_address']}:{int(body['master_port'])}"
    name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
    return backend, init, int(body["world_size"]), rank, name


def _is_gloo(group) -> bool:
    try:
        return isinstance(group._get_backend(torch.device("cpu")), torch.distributed.ProcessGroupGloo)
    except RuntimeError:
        return False


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding the tensors' bytes in order, no padding (SGLang's "flattened_bucket")."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unflatten(buffer: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset % torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"flattened bucket: offset {offset} is not aligned for {dtype}")
        tensors.append(buffer[offset : offset + size].view(dtype).view(shape))
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"flattened bucket has {buffer.numel()} bytes but the specs describe {offset}")
    return tensors


ALIGNMENT = 256  # bytes: each tensor of a streamed bucket starts here (checkpoint-engine's alignment), so views work


def bucket_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a streamed bucket, and the bucket's size: tensors in order, each aligned."""
    offsets, size = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offsets.append(size)
        size += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    return offsets, size


def flatten_aligned(
    tensors: Iterable[torch.Tensor], dtypes: list[torch.dtype], shapes: list[list[int]], out: torch.Tensor
) -> torch.Tensor:
    """Writes the tensors (of `dtypes`, each of `shapes`' size, in any shape and strides: their elements in order) at
    their `bucket_layout` offsets into `out` (uint8, at least the bucket's size), in one call; returns the bucket's
    part of it."""
    offsets, size = bucket_layout(dtypes, shapes)
    tensors = list(tensors)
    copy_all(places_of(out, tensors, dtypes, offsets), tensors)
    return out[:size]


def places_of(out: torch.Tensor, tensors: list[torch.Tensor], dtypes: list[torch.dtype], offsets: list[int]) -> list:
    """Each tensor's place in the uint8 `out`: a tensor of its dtype and shape at its offset."""
    typed: dict = {}
    return [view_at(out, typed, d, t.shape, o) for t, d, o in zip(tensors, dtypes, offsets, strict=True)]


def copy_all(places: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copies each tensor into its place: one `torch._foreach_copy_` per dtype for the dense tensors (its fast route, a
    kernel for many, takes only those) and one for the strided views (q, k and v out of a fused weight), which it
    copies one by one."""
    kinds: dict = {}
    for place, tensor in zip(places, tensors, strict=True):
        kind = kinds.setdefault((tensor.dtype, tensor.is_contiguous()), ([], []))
        kind[0].append(place)
        kind[1].append(tensor)
    for into, sources in kinds.values():
        torch._foreach_copy_(into, sources)


def flat_views(buffer: torch.Tensor, dtypes: list[torch.dtype], numels: list[int], offsets: list[int]) -> list:
    """1-D views of the uint8 `buffer`: `numels[i]` elements of `dtypes[i]` at byte `offsets[i]`, made by one split a
    dtype (a view op a tensor costs microseconds, hundreds of them a bucket); ValueError where one does not fit,
    aligned."""
    views: list = [None] * len(dtypes)
    for dtype in set(dtypes):
        typed = _as(buffer, dtype)
        sizes, kept, end = [], [], 0
        for i in sorted((i for i, d in enumerate(dtypes) if d == dtype), key=offsets.__getitem__):
            offset, numel = offsets[i], numels[i]
            _check_fits(buffer, dtype, numel, offset)
            start = offset // dtype.itemsize
            if start < end:  # it shares bytes with the one before: a view of its own
                views[i] = typed[start : start + numel]
                continue
            sizes += [start - end, numel]
            kept.append((i, len(sizes) - 1))
            end = start + numel
        parts = typed.split_with_sizes([*sizes, typed.numel() - end])
        for i, part in kept:
            views[i] = parts[part]
    return views


def view_at(buffer: torch.Tensor, typed: dict, dtype: torch.dtype, shape, offset: int) -> torch.Tensor:
    """The tensor of `dtype` and `shape` at byte `offset` of the uint8 `buffer`, in one view op (`typed` keeps the
    buffer viewed as each dtype); ValueError where it does not fit, aligned."""
    _check_fits(buffer, dtype, torch.Size(shape).numel(), offset)
    if dtype not in typed:
        typed[dtype] = _as(buffer, dtype)
    flat = typed[dtype]
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return flat.as_strided(shape, strides[::-1], flat.storage_offset() + offset // dtype.itemsize)


def _as(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The uint8 `buffer` viewed as `dtype` (its whole elements)."""
    return buffer[: buffer.numel() // dtype.itemsize * dtype.itemsize].view(dtype)


def _check_fits(buffer: torch.Tensor, dtype: torch.dtype, numel: int, offset: int) -> None:
    if offset < 0 or offset % dtype.itemsize or offset + numel * dtype.itemsize > buffer.numel():
        size = numel * dtype.itemsize
        raise ValueError(f"{size} bytes at offset {offset} do not fit the {buffer.numel()}-byte buffer aligned")
