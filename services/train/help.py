"""`slipstream train --help` and `--help-all`. The first is one screen: the flags a slime user reaches for first, with
their defaults, in the sections of services/common/sections.py. The second is every flag `slipstream train` accepts —
the launcher's and the four services', each once with the services that take it, slime's flags that are accepted and
ignored, and the `--sglang-*` pass-through — so that no flag is only in a service's own `--help`."""

import argparse
import re
import shutil
import textwrap
from dataclasses import dataclass

from services.common.config import FieldFlag, HelpFormatter, add_flag, field_flags
from services.common.sections import SECTIONS, section_of
from services.rollout import sglang_options
from services.train import options

# Who takes a flag, in the order their help and default are preferred when several do (the trainer's
# --n-samples-per-prompt, 8, is the one the launcher gives the buffer too).
PARTS = {"launcher": options.TrainOptions, "trainer": options.TrainerConfig, "reward": options.RewardConfig,
         "buffer": options.BufferConfig, "rollout": options.RolloutConfig}  # fmt: skip
# What `slipstream train --help` shows: the flags a slime user sets first, listed under their sections.
FIRST = (
    "--hf-checkpoint", "--load", "--save", "--save-interval",
    "--prompt-data", "--input-key", "--label-key", "--apply-chat-template",
    "--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--num-rollout",
    "--rollout-max-response-len", "--rollout-temperature", "--async-buffer-size",
    "--rm-type", "--custom-rm-path",
    "--advantage-estimator", "--use-kl-loss", "--kl-loss-coef", "--eps-clip",
    "--lr", "--micro-batch-size", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--bf16",
    "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
    "--tensor-model-parallel-size", "--colocate",
    "--update-weights-interval",
    "--eval-prompt-data", "--eval-interval",
    "--engine-urls",
    "--run-id", "--use-wandb",
)  # fmt: skip
RECOMPUTE_HELP = {
    "--recompute-granularity": "slime's: any value but selective turns on --recompute-activations (every layer).",
    "--recompute-method": "slime's: accepted, no effect (recompute is every layer, uniform: --recompute-granularity).",
    "--recompute-num-layers": "slime's: accepted, no effect (one layer per chunk: --recompute-granularity).",
}
USAGE = "slipstream train [@RUN_FILE] [--FLAG VALUE ...] [--check] [--help-all]"
INTRO = (
    "Starts Redis, the buffer, the reward service, the gateway with its engines and the trainer, and trains; each of "
    "slime's flags goes to the services that take it. Required: --hf-checkpoint, --prompt-data. slime's batch "
    "constraint: rollout-batch-size x n-samples-per-prompt = global-batch-size x num-steps-per-rollout."
)
FOOTER = (
    "--help-all shows every flag of every service and slime's flags accepted and ignored; --check validates the "
    "settings and exits, starting nothing. slime's arguments row by row: docs/ARGUMENTS.md."
)


@dataclass
class Entry:
    """One flag of `slipstream train` and the setting of each part (launcher or service) that takes it."""

    flag: str
    section: str
    takers: dict[str, FieldFlag]
    defaults: dict[str, str]

    @property
    def first(self) -> FieldFlag:
        return next(iter(self.takers.values()))

    def default(self) -> str:
        """The default, or each part's when they differ (`buffer 600.0, rollout 120.0`)."""
        shown = {part: value for part, value in self.defaults.items() if value}
        if len(set(shown.values())) <= 1:
            return next(iter(shown.values()), "")
        return ", ".join(f"{part} {value}" for part, value in shown.items())

    def help_text(self) -> str:
        """The setting's help, the parts that take it when several do, and the default. Parts that describe it
        differently (the buffer tokenizes with --hf-checkpoint, the trainer builds its model) are each quoted."""
        texts = {part: item.field.description or "" for part, item in self.takers.items()}
        if len(set(texts.values())) == 1:
            text = next(iter(texts.values()))
            text += f" [{', '.join(self.takers)}]" if len(self.takers) > 1 else ""
        else:
            text = " ".join(f"{part}: {description}" for part, description in texts.items())
        default = self.default()
        return f"{text} (default: {default})" if default else text


def catalogue() -> dict[str, Entry]:
    """Every field flag `slipstream train` routes, by flag, in the parts' declaration order."""
    own = {"--" + name.replace("_", "-") for name in options.OWN}
    launched = _launched_defaults()
    entries: dict[str, Entry] = {}
    for part, model in PARTS.items():
        for item in field_flags(model):
            if item.flag in own and part != "launcher":
                continue  # the launcher sets it for each service it starts
            entry = entries.setdefault(item.flag, Entry(item.flag, item.section, {}, {}))
            entry.takers[part] = item
            entry.defaults[part] = launched.get((part, item.flag), _shown(item))
    return entries


def short_help(width: int | None = None) -> str:
    """One screen: the FIRST flags under their sections, one line each: flag, default, the help's first sentence."""
    width = width or _width()
    entries = catalogue()
    lines = [f"usage: {USAGE}", "", *textwrap.wrap(INTRO, width, break_on_hyphens=False), ""]
    for section, title in SECTIONS.items():
        flags = [flag for flag in FIRST if entries[flag].section == section]
        if flags:
            lines.append(f"{title}:")
        for flag in flags:
            entry = entries[flag]
            lines.append(_row(flag, entry.default(), entry.first.field.description or "", width))
        if section == "deployment":
            text = "Given to launched engines as --<option> VALUE"
            lines.append(_row("--sglang-<option> VALUE", "", text, width))
    return "\n".join([*lines, "", *textwrap.wrap(FOOTER, width, break_on_hyphens=False)])


def _row(flag: str, default: str, description: str, width: int) -> str:
    """`  --flag  default  summary`: the help's first sentence without its asides, cut to fit."""
    left = f"  {flag:<29} {default:<8} " if len(flag) <= 29 else f"  {flag:<38} "
    summary = re.sub(r" \([^()]*\)", "", _first_sentence(description))
    return _clipped(left + summary, width)


def full_help(width: int | None = None) -> str:
    """Every flag `slipstream train` accepts, in sections, then slime's ignored flags and the SGLang pass-through."""
    width = width or _width()
    parser = argparse.ArgumentParser(prog="slipstream train", usage=USAGE, description=INTRO, add_help=False,
                                     formatter_class=lambda prog: HelpFormatter(prog, width=width))  # fmt: skip
    general = parser.add_argument_group("options")
    general.add_argument("-h", "--help", action="store_true", help="the flags to set first, on one screen")
    general.add_argument("--help-all", action="store_true", help="this list")
    general.add_argument("--check", action="store_true", help="validate the settings and exit without starting")
    general.add_argument("@RUN_FILE", nargs="?", help="read flags from this file (shell words, # comments)")
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items()}
    entries = catalogue()
    for flag in sorted(entries, key=lambda flag: flag not in FIRST):  # in each section, the first-needed first
        add_flag(groups[entries[flag].section], entries[flag].first, entries[flag].help_text())
    for flag, (value, reason) in options.NEUTRAL.items():
        name = flag.removeprefix("--").replace("-", "_")
        groups[section_of(name)].add_argument(flag, metavar=value, help=f"slime's: accepted at {value} only: {reason}.")
    for flag in options.RECOMPUTE:
        groups[section_of(flag.removeprefix("--").replace("-", "_"))].add_argument(flag, help=RECOMPUTE_HELP[flag])
    return "\n".join([parser.format_help().rstrip(), "", _ignored(width), "", _sglang(width), ""])


def _ignored(width: int) -> str:
    """slime's flags accepted and ignored (with a warning), by reason."""
    reasons: dict[str, list[str]] = {}
    for flag, reason in options.IGNORED.items():
        reasons.setdefault(reason, []).append(flag)
    lines = ["slime's flags accepted and ignored (a warning says why):"]
    for reason, flags in reasons.items():
        text = f"{reason}: {' '.join(flags)}"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def _sglang(width: int) -> str:
    release, names = sglang_options.pinned()
    text = (
        f"--sglang-<option> VALUE goes to every engine the gateway launches (--rollout-num-gpus) as --<option> "
        f"VALUE, e.g. --sglang-mem-fraction-static 0.8. <option> is any of SGLang {release}'s {len(names)} server "
        f"arguments (services/rollout/sglang_server_args.txt); another stops the run before it starts, naming the "
        f"closest. The gateway sets --model-path, --tp-size, --host and --port itself. Engines given by --engine-urls "
        f"keep their own options."
    )
    lines = textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(["SGLang pass-through:", *lines])


def _launched_defaults() -> dict[tuple[str, str], str]:
    """What the launcher passes each service when given no flag (the buffer's --n-samples-per-prompt is the
    trainer's), by (part, flag)."""
    values: dict[tuple[str, str], str] = {}
    for part, argv in options.route([]).items():
        flag = None
        for arg in argv:
            if arg.startswith("--"):
                flag = arg
                values[(part, flag)] = ""
            elif flag is not None:
                values[(part, flag)] = " ".join(filter(None, [values[(part, flag)], arg]))
    return values


def _shown(item: FieldFlag) -> str:
    """A setting's default as a command line would give it: on/off, space-separated lists, nothing for none."""
    value = item.field.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value in ("", [], {}) or item.field.default_factory is not None:
        return ""
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _first_sentence(text: str) -> str:
    """The text up to its first full stop or semicolon outside parentheses, without it."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".;" and text[i + 1 : i + 2] in ("", " ", "\n"):
            return text[:i]
    return text


def _clipped(line: str, width: int) -> str:
    """`line` cut at a word to `width` columns, with an ellipsis where it was cut."""
    if len(line) <= width:
        return line
    return re.sub(r"\s+\S*$", "", line[: width - 1]) + "…"


def _width() -> int:
    """The terminal's width, within 80 to 120 columns (100 when not a terminal)."""
    return min(max(shutil.get_terminal_size((100, 24)).columns, 80), 120)
