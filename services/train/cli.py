"""The `slipstream` command: dispatches to one service's entry point, importing nothing heavy until then.

`slipstream --help` must be instant, so subcommands are looked up in a table and their modules imported only when run.
"""

import difflib
import importlib
import importlib.util
import sys

COMMANDS = {  # in the order a newcomer reaches for them: a run first, each service on its own after
    "train": ("services.train.run", "start the whole system locally (or join running services) and train"),
    "demo": ("services.train.demo", "train a tiny model on a toy task and show that it learns"),
    "buffer": ("services.buffer.__main__", "run the data buffer service (datasets, leases, batches; port 50051)"),
    "rollout": ("services.rollout.__main__", "run the rollout gateway (engines, rollout workers, weight sync; 50052)"),
    "reward": ("services.reward.__main__", "run the reward service (verifiers, custom and remote rewards; 50053)"),
    "trainer": ("services.trainer.__main__", "run the trainer's control service (50054)"),
    "engine": ("services.engine.__main__", "run the reference engine (SGLang's HTTP API on HF models; 30000)"),
    "receiver": ("services.receiver.__main__", "run the weight receiver beside an engine (streamed weights; 30100)"),
    "convert-gguf": ("services.train.convert_gguf", "write a GGUF model (or the packaged smollm2) as an HF checkpoint"),
    "reasoning-gym": ("services.buffer.reasoning_gym", "write a reasoning-gym task's problems as prompt data (JSONL)"),
}
# The extra a command needs beyond the base install (buffer, reward and rollout need none).
NEEDS = {"trainer": "trainer", "engine": "engine", "receiver": "engine", "train": "all", "demo": "all",
         "convert-gguf": "gguf", "reasoning-gym": "tasks"}  # fmt: skip
# The modules each extra brings (pyproject.toml's optional dependencies).
EXTRAS = {
    "trainer": ("torch", "megatron.core", "safetensors", "tensorboard"),
    "engine": ("torch", "safetensors", "starlette", "uvicorn", "zmq"),
    "gguf": ("torch", "gguf"),
    "tasks": ("reasoning_gym",),
    "all": (
        "torch",
        "megatron.core",
        "safetensors",
        "tensorboard",
        "starlette",
        "uvicorn",
        "zmq",
        "rich",
        "matplotlib",
    ),
}

USAGE = """usage: slipstream <command> [options]

RL post-training for LLMs as services that speak gRPC.

commands:
{commands}

Run `slipstream <command> --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
        print(USAGE.format(commands=lines))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from slipstream import __version__

        print(f"slipstream {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(COMMANDS)}"
        print(f"slipstream: unknown command {name!r}; {hint}", file=sys.stderr)
        return 2
    if any(arg.startswith("@") for arg in rest):  # a run file (services/train/runfile.py)
        from services.common.config import ConfigError
        from services.train.runfile import expand

        try:
            rest = expand(name, rest)
        except ConfigError as e:
            print(f"slipstream {name}: error: {e}", file=sys.stderr)
            return 2
    module, extra = COMMANDS[name][0], NEEDS.get(name)
    missing = [m for m in EXTRAS.get(extra, ()) if not _installed(m)]
    if missing:
        print(
            f"slipstream {name} needs the {extra!r} extra ({', '.join(missing)} not installed): "
            f"pip install 'slipstream[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(module).main(rest)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
