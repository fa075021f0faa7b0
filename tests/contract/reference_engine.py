"""What the reference engine (`slipstream engine`) serves, read from its source with `ast`: each route with its HTTP
methods and the request fields its handler reads (`body.get("k")`, `body["k"]`, and the same in the methods and
helpers it calls), and the `sampling_params` keys it accepts."""

import ast
from pathlib import Path

from tests.python_source import parse

ENGINE = Path(__file__).resolve().parents[2] / "services" / "engine"
SOURCES = ("api.py", "weights.py", "ipc.py", "disk.py", "lora.py")  # the route tables and their handlers


def served() -> dict[str, tuple[set[str], set[str]]]:
    """path → (HTTP methods, request fields the handler reads)."""
    routes = {}
    for name in SOURCES:
        tree = parse((ENGINE / name).read_text())
        functions = _functions(tree)
        for path, handler, methods in _route_table(functions["routes"]):
            routes[path] = (methods, _fields_read(handler, functions, set()))
    return routes


def sampling_keys() -> set[str]:
    """The keys parse_sampling accepts: SamplingParams' fields and IGNORED_DEFAULTS' keys (sampling.py)."""
    tree = parse((ENGINE / "sampling.py").read_text())
    keys = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
            keys |= {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "IGNORED_DEFAULTS":
            keys |= {k.value for k in node.value.keys}
    return keys


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of the module by name (method names do not collide across its classes)."""
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _route_table(routes: ast.FunctionDef) -> list[tuple[str, str, set[str]]]:
    """The (path, handler, methods) tuples of a `routes()` method; methods are a list or a name given one before."""
    named: dict[str, set[str]] = {}
    for node in ast.walk(routes):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple | ast.Name):
            targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else [node.targets[0]]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for target, value in zip(targets, values, strict=False):
                if isinstance(value, ast.List) and all(isinstance(e, ast.Constant) for e in value.elts):
                    named[target.id] = {e.value for e in value.elts}
    table = []
    for node in ast.walk(routes):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and isinstance(node.elts[0], ast.Constant):
            path, handler, methods = node.elts
            methods = {e.value for e in methods.elts} if isinstance(methods, ast.List) else named[methods.id]
            table.append((path.value, handler.attr, methods))
    return table


def _fields_read(name: str, functions: dict, seen: set[str]) -> set[str]:
    """The request fields function `name` reads from the request body, with those of the functions it calls."""
    seen.add(name)
    function = functions[name]
    readers = _key_readers(function)
    fields = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            key = node.args[0] if node.args else None
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            reads = callee in readers or (callee == "get" and _is_body(getattr(node.func, "value", None)))
            if reads and isinstance(key, ast.Constant) and isinstance(key.value, str):
                fields.add(key.value)
            if callee in functions and callee not in seen and callee != "get":
                fields |= _fields_read(callee, functions, seen)
        if isinstance(node, ast.Subscript) and _is_body(node.value) and isinstance(node.slice, ast.Constant):
            fields.add(node.slice.value)
    return fields


def _is_body(node: ast.expr) -> bool:
    """The request body: a name `body`, or an awaited read of it (`(await request.json()).get(...)`)."""
    return (isinstance(node, ast.Name) and node.id == "body") or isinstance(node, ast.Await)


def _key_readers(function: ast.AST) -> set[str]:
    """Local lambdas that read the body by their first argument (`pick = lambda key, default: body.get(key, …)`)."""
    readers = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)):
            continue
        first = node.value.args.args[0].arg
        calls = [c for c in ast.walk(node.value.body) if isinstance(c, ast.Call) and c.args]
        if any(_is_body(getattr(c.func, "value", None)) and getattr(c.args[0], "id", None) == first for c in calls):
            readers.add(node.targets[0].id)
    return readers
