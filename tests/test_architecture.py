"""The map of docs/architecture.md, held: each service folder imports the shared layer, its own modules, and only
the other services' modules the map names (the buffer's declared data plane, the trainer's table of model families,
the reference engine's IPC protocol for its receiver, and every service's options for `slipstream train`)."""

import ast
from pathlib import Path

from tests.python_source import parse

SERVICES = Path(__file__).resolve().parents[1] / "services"
ALLOWED = {  # folder: the other services' modules it may import
    "common": set(),
    "buffer": set(),
    "reward": set(),
    "rollout": {"services.buffer.dataplane"},
    "trainer": {"services.buffer.dataplane"},
    "engine": {"services.trainer.families"},
    "receiver": {"services.engine.ipc", "services.engine.responses", "services.engine.server"},
    "train": {"services.buffer.config", "services.buffer.datasets", "services.reward.config",
              "services.rollout.config", "services.rollout.sglang_options", "services.trainer.config",
              "services.trainer.batching", "services.buffer.preflight", "services.reward.preflight",
              "services.rollout.preflight", "services.trainer.preflight"},
}  # fmt: skip


def imported(path: Path) -> set[str]:
    """The modules of services.* that `path` imports (`from services.x import y` names services.x.y when y is a
    module, else services.x)."""
    names = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                module = f"{node.module}.{alias.name}"
                as_path = SERVICES.parent / module.replace(".", "/")
                names.add(module if as_path.with_suffix(".py").exists() or as_path.is_dir() else node.module)
    return {name for name in names if name.startswith("services.")}


def test_every_service_folder_is_on_the_map():
    folders = {p.name for p in SERVICES.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED)


def test_each_service_imports_only_what_the_map_allows():
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((SERVICES / folder).rglob("*.py")):
            for module in imported(path):
                owner = module.split(".")[1] if "." in module else ""
                if owner not in (folder, "common") and module not in allowed:
                    wrong.append(f"{path.relative_to(SERVICES.parent)} imports {module}")
                if folder == "common" and owner != "common":
                    wrong.append(f"{path.relative_to(SERVICES.parent)} (the shared layer) imports {module}")
    assert wrong == []
