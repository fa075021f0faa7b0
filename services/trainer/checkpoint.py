"""Training checkpoints for exact resume: every rank's model shard, optimizer and scheduler state, the random
number generators, the step and the policy version, in Megatron's layout (`iter_0000042/mp_rank_00_000.pt` and
`latest_checkpointed_iteration.txt`); with the distributed optimizer each data-parallel rank also writes its shard of
the optimizer (`mp_rank_00_000_optim_dp001.pt`). A checkpoint is written to a temporary folder and renamed into
place, and the `latest` file is written last, so a crash mid-save leaves the previous checkpoint as the latest."""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"


def shard_name(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """Megatron's names: `mp_rank_{tp}_{pp}`, and `_{ep}` after them with expert parallelism."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + ("" if ep_rank is None else f"_{ep_rank:03d}") + ".pt"


def optimizer_shard_name(shard: str, dp_rank: int) -> str:
    """A data-parallel rank's shard of the distributed optimizer: the model shard's name with `_optim_dpDDD`
    (`mp_rank_01_000_optim_dp003.pt`)."""
    return f"{shard.removesuffix('.pt')}_optim_dp{dp_rank:03d}.pt"


def save(
    root: Path,
    step: int,
    state: dict,
    shard: str = shard_name(0, 0),
    writes: bool = True,
    own: tuple[str, dict] | None = None,
) -> Path:
    """Writes this rank's `state` (model, optimizer, scheduler, extras) with the RNG states as `shard` where `writes`
    (one rank of each model shard: the others hold copies), and `own` (file name, state), what only this rank holds
    (its shard of a distributed optimizer), whatever `writes` says; all ranks wait for each other, and rank 0 then
    publishes the step as the latest. A file that cannot be written (a full disk, a permission) on any rank raises
    the same OSError on every rank, and the latest checkpoint stays the previous one."""
    root = Path(root)
    final = root / f"iter_{step:07d}"
    staging = root / f".iter_{step:07d}.partial"

    def prepare() -> None:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

    def write() -> None:
        if writes:
            torch.save({**state, "step": step, "rng": rng_state()}, staging / shard)
        if own is not None:
            torch.save({**own[1], "step": step}, staging / own[0])

    def publish() -> None:
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            (root / f"{LATEST}.tmp").write_text(str(step))
            os.replace(root / f"{LATEST}.tmp", root / LATEST)

    for part in (prepare, write, publish):
        _together(part)
    return final


def latest_step(root: Path) -> int | None:
    path = Path(root) / LATEST
    return int(path.read_text().strip()) if path.is_file() else None


def load(
    root: Path, shard: str = shard_name(0, 0), step: int | None = None, own: str | None = None, rng: bool = True
) -> dict:
    """This rank's state (`shard`, and the file `own` merged in) of the latest (or the given) step; restores the RNG
    states (unless not `rng`)."""
    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"{root} holds no checkpoint ({LATEST} is missing); check --load")
    path = Path(root) / f"iter_{step:07d}" / shard
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint shard {path} is missing: was it saved with another TP/PP/EP size?")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if own is not None:
        if not (path.parent / own).is_file():
            raise FileNotFoundError(
                f"optimizer shard {path.parent / own} is missing: was it saved without "
                "--use-distributed-optimizer, or with another data-parallel size?"
            )
        state.update(torch.load(path.parent / own, map_location="cpu", weights_only=False))
    saved_rng = state.pop("rng")
    if rng:
        set_rng_state(saved_rng)
    return state


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:  # Megatron's tensor-parallel RNG tracker (dropout inside TP regions)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["megatron"] = get_cuda_rng_tracker().get_states()
    except (ImportError, AssertionError, RuntimeError):
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["megatron"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _together(part) -> None:
    """Runs this rank's `part` of a save, then waits for every rank's; an OSError on any rank is raised on all."""
    failure = ""
    try:
        part()
    except OSError as e:
        failure = f"{e.strerror or e} ({e.filename})" if e.filename else str(e.strerror or e)
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [""] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    failure = next((f for f in failures if f), "")
    if failure:
        raise OSError(failure)
