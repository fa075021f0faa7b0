"""The command-line options of an SGLang release's server (`python -m sglang.launch_server`), read from the release's
own sources without importing them (importing needs its CUDA dependencies). Writes one option a line to
services/rollout/sglang_server_args.txt, the pinned release's list: `slipstream train` refuses a --sglang-<option>
that is not in it, and the tests hold our compose files' and manifests' SGLang command lines against it
(tests/contract checks that it is what the pinned wheel gives; docs/engine.md, "SGLang versions", says how to re-pin).

    pip download sglang==0.5.23 --no-deps --only-binary=:all: --python-version 3.11 \\
        --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 -d .cache/sglang
    python tools/sglang_server_args.py .cache/sglang/sglang-0.5.23-*.whl > services/rollout/sglang_server_args.txt

What it reads: every `A[T, "help"]` / `A[T, Arg(...)]` field of the ServerArgs field groups
(`sglang/srt/arg_groups/fields/`; the option is `--field-name`, or Arg's `cli_name` and `aliases`, none with
`no_cli=True`), as `add_cli_args_from_dataclass` registers them, and every literal `add_argument("--…")` in
`sglang/srt/server_args.py` and `sglang/srt/arg_groups/`.
"""

import ast
import sys
import zipfile
from pathlib import Path

SOURCES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/")


def _arg_options(name: str, meta: ast.expr) -> list[str]:
    if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
        return ["--" + name.replace("_", "-")]
    if not (isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg"):
        return []
    keywords = {k.arg: k.value for k in meta.keywords}
    if isinstance(keywords.get("no_cli"), ast.Constant) and keywords["no_cli"].value is True:
        return []
    cli_name = keywords.get("cli_name")
    options = [cli_name.value if isinstance(cli_name, ast.Constant) else "--" + name.replace("_", "-")]
    aliases = keywords.get("aliases")
    if isinstance(aliases, ast.List):
        options += [a.value for a in aliases.elts if isinstance(a, ast.Constant)]
    return options


def options_of(source: str, fields: bool) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if fields and isinstance(node, ast.ClassDef):
            for item in node.body:
                annotation = getattr(item, "annotation", None)
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and isinstance(annotation, ast.Subscript)
                    and isinstance(annotation.slice, ast.Tuple)
                    and getattr(annotation.value, "id", "") in ("A", "Annotated")
                ):
                    found.update(_arg_options(item.target.id, annotation.slice.elts[-1]))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return found


def server_options(wheel: Path) -> list[str]:
    found = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".py") and name.startswith(SOURCES):
                found |= options_of(archive.read(name).decode(), fields="/arg_groups/fields/" in name)
    return sorted(found)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(listing(Path(sys.argv[1])), end="")
    return 0


def listing(wheel: Path) -> str:
    """The option list as the file holds it: a header naming the wheel, then one option a line."""
    options = "\n".join(server_options(wheel))
    return f"# SGLang's server options, from {wheel.name} by tools/sglang_server_args.py\n{options}\n"


if __name__ == "__main__":
    sys.exit(main())
