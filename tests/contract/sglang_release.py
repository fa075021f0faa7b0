"""What an SGLang (or sglang-router) release accepts, read from its wheel's sources with `ast` (importing them needs
CUDA): the HTTP routes and their methods, each route's request structure (io_struct.py) with its fields, the
`sampling_params` keys, the server's options and the router's. `problems` holds a request against them."""

import ast
import difflib
import re
import zipfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tests.python_source import parse
from tools.sglang_server_args import server_options

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_CONTRACT = "sglang/api/v1/api_types.py"  # >= 0.5.22: the /generate gate, unknown sampling keys refused
SAMPLING = "sglang/srt/sampling/sampling_params.py"
DECORATORS = {"get": {"GET"}, "post": {"POST"}, "put": {"PUT"}, "delete": {"DELETE"}, "head": {"HEAD"}}


@dataclass
class Struct:
    name: str
    fields: set[str] = field(default_factory=set)
    required: set[str] = field(default_factory=set)


class Release:
    """One sglang wheel."""

    def __init__(self, wheel: Path):
        self.wheel = wheel
        self.version = wheel.name.split("-")[1]
        self._zip = zipfile.ZipFile(wheel)

    def source(self, name: str) -> ast.Module | None:
        try:
            return parse(self._zip.read(name).decode())
        except KeyError:
            return None

    @cached_property
    def structs(self) -> dict[str, Struct]:
        """The classes of io_struct.py with their fields (inherited ones included) and which have no default."""
        classes = {n.name: n for n in self.source(IO_STRUCT).body if isinstance(n, ast.ClassDef)}
        return {name: _struct(name, classes) for name in classes}

    @cached_property
    def routes(self) -> dict[str, tuple[set[str], Struct | None]]:
        """path → (HTTP methods, the request structure its handler takes: None for none of io_struct's)."""
        routes: dict[str, tuple[set[str], Struct | None]] = {}
        for node in ast.walk(self.source(HTTP_SERVER)):
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            struct = self.structs.get(_body_type(node))
            for decorator in node.decorator_list:
                route = _route(decorator)
                if route is not None:
                    methods = routes.setdefault(route[0], (set(), struct))[0]
                    methods |= route[1]
        return routes

    @cached_property
    def sampling_keys(self) -> set[str]:
        """The keys /generate's `sampling_params` may hold: the contract's SamplingParams where the release has one,
        else the parameters of SamplingParams.__init__."""
        contract = self.source(SAMPLING_CONTRACT)
        if contract is not None:
            classes = {n.name: n for n in contract.body if isinstance(n, ast.ClassDef)}
            return _struct("SamplingParams", classes).fields
        for node in ast.walk(self.source(SAMPLING)):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                return {a.arg for a in node.args.args + node.args.kwonlyargs} - {"self"}
        raise AssertionError(f"no SamplingParams in {self.wheel.name}")

    @cached_property
    def server_options(self) -> set[str]:
        return set(server_options(self.wheel))


def problems(release: Release, method: str, path: str, body: dict | None = None, required: bool = True) -> list[str]:
    """What SGLang `release` would not take of a request: an unknown route or method, a body field its request
    structure lacks (SGLang ignores unknown fields: a renamed field silently does nothing), a required field
    missing (unless not `required`: a server reading fewer fields), a `sampling_params` key it does not know (refused
    from 0.5.22). Empty when all is well."""
    where = f"{method} {path} (sglang {release.version})"
    if path not in release.routes:
        return [f"{where}: no such route in {HTTP_SERVER}"]
    methods, struct = release.routes[path]
    if method not in methods:
        return [f"{where}: the route takes {sorted(methods)}"]
    body = body or {}
    if struct is None:
        return [f"{where}: the route takes no request structure, got fields {sorted(body)}"] if body else []
    found = [f"{where}: {struct.name} has no field {k!r}{_closest(k, struct.fields)}" for k in body
             if k not in struct.fields]  # fmt: skip
    found += [f"{where}: {struct.name} requires {k!r}" for k in sorted(struct.required - set(body)) if required]
    sampling = body.get("sampling_params") or {}
    for params in sampling if isinstance(sampling, list) else [sampling]:
        found += [f"{where}: sampling_params has no key {k!r}{_closest(k, release.sampling_keys)}"
                  for k in params if k not in release.sampling_keys]  # fmt: skip
    return found


def router_options(wheel: Path) -> dict[str, list | None]:
    """sglang-router's launch_router options (its router_args.py, without the `router-` prefix that launch_router
    does not use) → their `choices` where they are a literal list."""
    options: dict[str, list | None] = {}
    with zipfile.ZipFile(wheel) as archive:
        tree = parse(archive.read("sglang_router/router_args.py").decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            choices = next((k.value for k in node.keywords if k.arg == "choices"), None)
            values = ast.literal_eval(choices) if isinstance(choices, ast.List) else None
            for arg in node.args:
                flag = _literal_text(arg)
                if flag and flag.startswith("--"):
                    options[flag] = values
    return options


def _literal_text(node: ast.expr) -> str | None:
    """A string constant, or an f-string with its substitutions dropped (router_args' f"--{prefix}policy")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(p.value for p in node.values if isinstance(p, ast.Constant))
    return None


def _struct(name: str, classes: dict[str, ast.ClassDef]) -> Struct:
    struct = Struct(name)
    node = classes[name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            inherited = _struct(base.id, classes)
            struct.fields |= inherited.fields
            struct.required |= inherited.required
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(item.annotation):
            continue
        struct.fields.add(item.target.id)
        if item.value is None or _field_without_default(item.value):
            struct.required.add(item.target.id)
        else:
            struct.required.discard(item.target.id)
    return struct


def _field_without_default(value: ast.expr) -> bool:
    """A dataclass `field(...)` with neither default nor default_factory."""
    return (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field"
            and not {k.arg for k in value.keywords} & {"default", "default_factory"})  # fmt: skip


def _body_type(handler: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """The class named by the handler's first parameter (`obj: X`, `Annotated[X, Body()]`, `Optional[X]`)."""
    if not handler.args.args or handler.args.args[0].annotation is None:
        return None
    names = re.findall(r"\b[A-Z]\w+\b", ast.unparse(handler.args.args[0].annotation))
    return next((n for n in names if n not in ("Annotated", "Optional", "Body")), None)


def _route(decorator: ast.expr) -> tuple[str, set[str]] | None:
    """`@app.get("/x")`, `@app.post("/x")`, `@app.api_route("/x", methods=[...])` → (path, methods)."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute) and decorator.args):
        return None
    path = decorator.args[0]
    if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
        return None  # a route taken from the environment (Ollama's, Vertex's)
    verb = decorator.func.attr
    if verb == "api_route":
        methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
        return path.value, set(ast.literal_eval(methods)) if methods is not None else {"GET"}
    return (path.value, DECORATORS[verb]) if verb in DECORATORS else None


def _closest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
