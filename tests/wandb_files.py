"""Reads a W&B run's own file (`run-<id>.wandb`, what an offline run writes and `wandb sync` uploads): W&B's records,
framed as LevelDB's log is (32 KiB blocks of checksummed chunks) behind a 7-byte `:W&B` header."""

from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """The run's records (wandb.proto.wandb_internal_pb2.Record; imported here: a machine without wandb can still
    import the tests that use this module)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending, out = 7, b"", []
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or kind == 0:  # the rest of the block is padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, str]]:
    """Each logged row: {metric: its JSON value}."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]  # fmt: skip


def config(path: Path) -> dict[str, str]:
    """The run's config: {key: its JSON value}."""
    out = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out.update({item.key or "/".join(item.nested_key): item.value_json for item in items})
    return out


def run_file(folder: Path) -> Path:
    """The one W&B run file under `folder` (its wandb/ folder)."""
    found = list(folder.glob("wandb/*run-*/run-*.wandb"))
    assert len(found) == 1, found
    return found[0]
