"""The map of docs/architecture.md, held: each service folder imports the shared layer, its own modules, and only
the other services' modules the map names (the buffer's declared data plane, the reference engine's IPC protocol for
its receiver, and every service's options for `slipstream train`); the engine imports nothing of the trainer; the
`slipstream` package (the protos' stubs, samples) is the bottom layer and imports no service; no two modules import
each other, directly or through others."""

import ast
from pathlib import Path

from tests.python_source import parse

REPO = Path(__file__).resolve().parents[1]
SERVICES = REPO / "services"
SHARED = ("common", "weightsync")  # the layers every service may import: weightsync over common
ALLOWED = {  # folder: the other services' modules it may import
    "common": set(),
    "weightsync": set(),
    "buffer": set(),
    "reward": set(),
    "rollout": {"services.buffer.dataplane"},
    "trainer": {"services.buffer.dataplane"},
    "engine": set(),
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
                if owner not in (folder, *SHARED) and module not in allowed:
                    wrong.append(f"{path.relative_to(SERVICES.parent)} imports {module}")
                if folder in SHARED and owner not in SHARED[: SHARED.index(folder) + 1]:
                    wrong.append(f"{path.relative_to(SERVICES.parent)} (a shared layer) imports {module}")
    assert wrong == []


def test_the_engine_imports_nothing_of_the_trainer():
    """The reference engine runs without megatron-core: what both read (which model types are MoE) lives in
    services/common/. Any import counts, one inside a function too."""
    wrong = [f"{path.relative_to(REPO)} imports {module}" for path in sorted((SERVICES / "engine").rglob("*.py"))
             for module in imported(path) if module.split(".")[:2] == ["services", "trainer"]]  # fmt: skip
    assert wrong == []


def test_the_slipstream_package_imports_no_service():
    wrong = [f"{path.relative_to(REPO)} imports {module}" for path in _modules().values() if
             path.is_relative_to(REPO / "slipstream") for module in imported(path)]  # fmt: skip
    assert wrong == []


def test_no_modules_import_each_other():
    """Any import counts, one inside a function too, and a package's import of its own modules as well; the import of
    a name its module re-exports counts as the module's."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = {_owner(module, modules) for module in imported(path) | _slipstream_imports(path)}
        graph[name] = {t for t in targets if t and t != name}
    assert _cycles(graph) == []


def _modules() -> dict[str, Path]:
    """Every module of services/ and slipstream/ (not the generated stubs), by its dotted name."""
    found = {}
    for path in [*SERVICES.rglob("*.py"), *(p for p in (REPO / "slipstream").rglob("*.py") if "v1" not in p.parts)]:
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _slipstream_imports(path: Path) -> set[str]:
    return {
        node.module for node in ast.walk(parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slipstream.")
        and "v1" not in node.module
    }  # fmt: skip


def _owner(module: str, modules: dict[str, Path]) -> str:
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_each_flag_has_one_owner():
    """A setting is declared once: by one service's config, by the shared groups (the server's, Redis's, the run's
    facts in services/common/run_facts.py) or by the launcher; `slipstream train` sends a flag to the parts that hold
    its owner, and refuses to build a table where two models declare one flag (tests/test_cli.py)."""
    from services.train.options import SERVICES, TrainOptions, takers

    takers({**SERVICES, "train": TrainOptions})  # raises on a flag with two owners


def test_no_function_in_services_is_over_80_lines():
    """A function longer than a screen is split into named steps (the style guide's bar)."""
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(SERVICES.rglob("*.py"))
        for node in ast.walk(parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80
    ]
    assert long == []
