"""The docs name only paths the repository has: every Markdown file's links, its inline code that looks like a
repository path, and the file names in its prose (`docs/rollout.md`, `engine.md`) resolve to a file or folder of the
checkout (what git tracks, or would: ignored files such as `.venv` or `runs/` are not the repository's), so a renamed
file or a path outside the repository fails here."""

import re
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
# A code span ending in one of these is a file name even without a folder.
SUFFIXES = (".py", ".pyi", ".md", ".yaml", ".yml", ".json", ".jsonl", ".toml", ".sh", ".proto", ".txt", ".flags",
            ".Dockerfile", ".png", ".cfg", ".ini")  # fmt: skip
# Files the docs name that are not ours: slime's and SGLang's sources, a checkpoint's or a run's files. Each is
# named as someone else's in the text around it.
NOT_OURS = {
    "train.py", "train_async.py",  # slime's entry points
    "io_struct.py", "http_server.py", "sampling_params.py", "tokenizer_manager.py", "schedule_batch.py",  # SGLang's
    "config.json", "adapter_config.json", "tokenizer_config.json", "generation_config.json",  # a checkpoint's
    "latest_checkpointed_iteration.txt",  # a Megatron checkpoint's
    "train.jsonl", "eval.jsonl", "held_out.jsonl", "steps.jsonl", "summary.json", "reward.png", "./wandb",  # a run's
}  # fmt: skip
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PLACEHOLDER = re.compile(r"[<>{}$*?\[\]|…]|\.\.\.|^[~/-]|://|^runs/|^path/to/|^file\.py")
PROSE = re.compile(r"(?<![\w/.`-])((?:\.\.?/)?(?:[\w.-]+/)*[\w.-]+\.(?:md|py|yaml|yml|toml|sh|proto|jsonl?))(?![\w/`])")
FUNCTION = re.compile(r"(?<=\.py)(::?[\w.\[\]-]+)$")  # file.py:function, file.py::test


@cache
def repository() -> frozenset[str]:
    """Every file of the checkout and every folder above one, as posix paths relative to the root."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    paths = {p for p in listed if p and (REPO / p).exists()}  # a file deleted in the tree is gone
    return frozenset(paths | {str(parent) for p in paths for parent in PurePosixPath(p).parents if str(parent) != "."})


def tails() -> dict[str, set[str]]:
    """Every path's last 1..n components, for partial paths (`families/registry.py`, `dataplane.py`)."""
    found: dict[str, set[str]] = {}
    for path in repository():
        parts = path.split("/")
        for i in range(1, len(parts)):
            found.setdefault("/".join(parts[i:]), set()).add(path)
    return found


TAILS = tails()
TOP = {path for path in repository() if "/" not in path}


def docs() -> list[str]:
    return sorted(p for p in repository() if p.endswith(".md") and (REPO / p).is_file())


def resolve(doc: str, target: str) -> str | None:
    """`target` relative to the doc's folder, as a repository path; None when it leaves the repository."""
    joined = PurePosixPath(doc).parent / target
    parts: list[str] = []
    for part in joined.parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def exists(doc: str, path: str, partial: bool) -> bool:
    path = path.rstrip("/")
    if path in repository() or resolve(doc, path) in repository():
        return True
    return partial and not path.startswith(("./", "../")) and path in TAILS


def broken_links(doc: str, text: str) -> list[str]:
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z+.-]*:", target) or target.startswith("#"):  # a URL, mailto:, an anchor
            continue
        path = target.split("#")[0].split("?")[0]
        if resolve(doc, path) not in repository():
            broken.append(f"link ({target})")
    return broken


def path_like(span: str) -> str | None:
    """The repository path a code span names, or None when it names none: a command line, a URL, a glob or
    placeholder, an absolute path, a run's output, a name that is no path (`Qwen/Qwen3-4B`, `rollout/step`)."""
    span = span.strip().rstrip(".,;:").removeprefix("@")  # @FILE: a run file
    if not span or span in SUFFIXES or any(c.isspace() for c in span) or PLACEHOLDER.search(span) or "=" in span:
        return None
    span = FUNCTION.sub("", span).split("#")[0]
    first = span.split("/")[0]
    if span.startswith(("./", "../")) or ("/" in span and first in TOP) or span.endswith(SUFFIXES):
        return span
    return None


def broken_code(doc: str, text: str) -> list[str]:
    """Code spans and, in the prose around them (links and URLs left out), file names."""
    text = FENCE.sub("", text)
    prose = re.sub(r"https?://\S+", "", LINK.sub("", CODE.sub("", text)))
    broken = []
    for span in CODE.findall(text) + PROSE.findall(prose):
        path = path_like(span)
        if path is None or path in NOT_OURS:
            continue
        partial = path.split("/")[0] not in TOP  # `services/x.py` is from the root; `x.py` may be a folder's
        if not exists(doc, path, partial):
            broken.append(f"`{span.strip()}`")
    return broken


def test_docs_name_only_paths_that_exist():
    broken = []
    for doc in docs():
        text = (REPO / doc).read_text()
        broken += [f"{doc}: {what}" for what in broken_links(doc, text) + broken_code(doc, text)]
    assert not broken, "paths the repository does not have:\n" + "\n".join(broken)


def test_the_check_catches_what_it_is_for():
    assert not exists("docs/engine.md", "../shared/SGLANG_API.md", partial=False)
    assert path_like("../shared/containers/setup.sh") == "../shared/containers/setup.sh"
    assert not exists("README.md", "../shared/containers/setup.sh", partial=False)  # outside the repository
    assert path_like("services/rollout/engines.py") and exists("docs/x.md", "services/rollout/engines.py", False)
    assert not exists("docs/x.md", "services/rollout/engine_pool.py", partial=False)  # a renamed file
    assert broken_links("docs/x.md", "[a](missing.md) [b](engine.md#sglang-versions) [c](https://x.org/a.md)") == [
        "link (missing.md)"
    ]
    assert path_like("examples/multi_turn_tools/agent.py:generate") == "examples/multi_turn_tools/agent.py"
    prose = "as docs/rollout.md says; engine.md; see docs/gone.md, set up by ../shared/containers/setup.sh"
    assert broken_code("docs/x.md", prose) == ["`docs/gone.md`", "`../shared/containers/setup.sh`"]
    not_paths = (
        "slipstream train --check", "<run>/summary.json", "runs/demo/reward.png", "/tmp/x.py",
        "protos/slipstream/v1/*.proto", "https://example.org/a.py", "Qwen/Qwen3-4B", "rollout/step",
    )  # fmt: skip
    for not_a_path in not_paths:
        assert path_like(not_a_path) is None, not_a_path


def test_the_benchmarks_page_holds_the_current_figures_in_25_kb():
    """docs/BENCHMARKS.md is a reference: the history goes to the dated reports under docs/benchmarks/."""
    page = REPO / "docs" / "BENCHMARKS.md"
    assert page.stat().st_size <= 25_000, f"{page} is {page.stat().st_size} bytes: move history to docs/benchmarks/"
    assert "## Current figures" in page.read_text()


def anchors(doc: str) -> set[str]:
    """The anchors GitHub gives the headings of `doc`: lower case, punctuation but - and _ dropped, spaces as -."""
    text = FENCE.sub("", (REPO / doc).read_text())
    titles = re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def test_links_into_a_doc_name_one_of_its_headings():
    broken = []
    for doc in docs():
        for target in LINK.findall((REPO / doc).read_text()):
            path, _, anchor = target.partition("#")
            if not anchor or re.match(r"[a-z][a-z+.-]*:", target) or not path.endswith(".md"):
                continue
            if anchor not in anchors(resolve(doc, path)):
                broken.append(f"{doc}: {target}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)
