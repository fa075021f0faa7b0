"""Service configuration: one pydantic model per service, read from a YAML/TOML file and overridden by flags.

Every field of a config model becomes a command-line flag (`port` → `--port`, nested `redis.url` → `--redis-url`;
a `flat` group's fields keep their own names: the trainer's `loss.eps_clip` → `--eps-clip`), so a run is one file plus
a few flags, and every bad value is reported as one sentence naming the field and its source.
"""

import argparse
import difflib
import json
import re
import sys
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.common.sections import SECTIONS, section_of


class ConfigError(Exception):
    """A configuration problem, worded for the user: what is wrong and how to fix it."""


def _http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ValueError(f"not a URL ({e}); pass http://host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http:// or https:// URL with a host; pass http://host:port")
    return value


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("not host:port; pass e.g. reward-service:50053")
    return value


HttpUrl = Annotated[str, AfterValidator(_http_url)]  # an address reached over HTTP, checked when it is given
HostPort = Annotated[str, AfterValidator(_host_port)]  # a gRPC address


def _model_type(annotation: Any) -> type["StrictModel"] | None:
    """The config model inside `annotation` (`X`, `X | None`), or None when it is a plain value."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, StrictModel):
            return candidate
    return None


def _flat_groups(model: type[BaseModel]) -> dict[str, type["StrictModel"]]:
    """The fields of `model` that hold a flat group, and the group's model."""
    groups = {}
    for name, field in model.model_fields.items():
        sub = _model_type(field.annotation)
        if sub is not None and sub.flat:
            groups[name] = sub
    return groups


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, field docstrings become the flags' help."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)
    flat: ClassVar[bool] = False
    # Other commands' names for this model's flags, said when one is given here (the engine's --model-path is
    # --hf-checkpoint elsewhere): {"--hf-checkpoint": "--model-path"}.
    other_names: ClassVar[dict[str, str]] = {}
    """A group of settings passed whole (the trainer's loss settings) whose fields keep their own flag names and
    config-file keys (`--eps-clip`, `eps_clip:`) where it is nested: slime's names stay as they are."""

    @model_validator(mode="before")
    @classmethod
    def _gather_flat(cls, data: Any) -> Any:
        """Moves the flat keys of each flat group (`eps_clip`) into that group (`loss`), so that the file's keys, the
        flags and keyword arguments (`TrainerConfig(eps_clip=0.3)`) stay flat."""
        if not isinstance(data, dict):
            return data
        for name, sub in _flat_groups(cls).items():
            keys = [key for key in data if key in sub.model_fields and key not in cls.model_fields]
            if keys:
                data = dict(data)
                group = data.get(name, {})
                group = group.model_dump(exclude_unset=True) if isinstance(group, BaseModel) else dict(group)
                data[name] = {**group, **{key: data.pop(key) for key in keys}}
        return data

    def __getattr__(self, name: str) -> Any:
        """A flat group's field read by its flat name (`config.lr` is `config.optimizer.lr`), as it is set and
        printed; code that uses a group takes the group itself."""
        for group in _flat_groups(type(self)):
            settings = self.__dict__.get(group)
            if settings is not None and name in type(settings).model_fields:
                return getattr(settings, name)
        return super().__getattr__(name)


class TlsConfig(StrictModel):
    """Transport security (flags --tls-cert-file, --tls-key-file, --tls-ca-file). A service with a certificate serves
    TLS only, and its own calls to other services use TLS too, presenting the same certificate."""

    cert_file: Path | None = None
    """PEM certificate (chain) this service presents; with --tls-key-file turns TLS on. Re-read when it changes."""
    key_file: Path | None = None
    """PEM private key of --tls-cert-file."""
    ca_file: Path | None = None
    """PEM CA bundle: a server requires client certificates signed by it (mutual TLS), a client checks servers with it
    (unset: the system's roots)."""

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @model_validator(mode="after")
    def _check(self) -> "TlsConfig":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together: pass both, or neither for plaintext")
        if self.ca_file is not None and self.cert_file is None:
            raise ValueError("--tls-ca-file needs --tls-cert-file and --tls-key-file (this service's own certificate)")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"--tls-{name.replace('_', '-')} {path}: no such file")
        return self


class AuthConfig(StrictModel):
    """Bearer tokens with roles (flag --auth-token-file)."""

    token_file: Path | None = None
    """File of `role token` lines (roles: worker, trainer, admin): every RPC but health and reflection needs a token of
    a role allowed to call it, and this service's own calls send the token of the role they need. Re-read when it
    changes. Unset: no authentication."""

    @model_validator(mode="after")
    def _check(self) -> "AuthConfig":
        if self.token_file is not None and not self.token_file.is_file():
            raise ValueError(f"--auth-token-file {self.token_file}: no such file")
        return self


class ServiceConfig(StrictModel):
    """Settings every gRPC service shares. Each service subclasses it and sets its own default port."""

    host: str = "0.0.0.0"
    """Address the gRPC server listens on."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    grace_period_s: float = Field(5.0, gt=0, le=300)
    """On SIGTERM, how long in-flight RPCs may finish before they are cancelled."""
    max_message_mb: int = Field(256, ge=1, le=2047)
    """Largest gRPC message in MiB: batches of long samples are large, the gRPC default of 4 MiB is too small."""
    keepalive_time_s: float = Field(30.0, gt=0)
    """Ping idle connections this often so that dead peers (a killed trainer, a dropped node) are noticed."""
    keepalive_timeout_s: float = Field(10.0, gt=0)
    """A connection whose keepalive ping is not answered within this many seconds is closed."""
    metrics_port: int | None = Field(0, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint; 0 picks a free one, null serves none."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level that is printed."""
    log_format: Literal["text", "json"] = "text"
    """`json` prints one JSON object per line, for log collectors."""
    tls: TlsConfig = TlsConfig()
    auth: AuthConfig = AuthConfig()


Config = TypeVar("Config", bound=StrictModel)


def command_config(model: type[Config], argv: list[str] | None, name: str) -> Config | None:
    """The config of `slipstream <name>`; None once each of its problems is printed as `slipstream <name>: error: …`
    (the command then exits 2)."""
    try:
        return load_config(model, argv, prog=f"slipstream {name}")
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"slipstream {name}: error: {line}", file=sys.stderr)
        return None


def load_config(model: type[Config], argv: list[str] | None, prog: str, description: str = "") -> Config:
    """Parses `--config FILE` plus one flag per field of `model`; the flags override the file."""
    usage = "%(prog)s [--config FILE] [--SETTING VALUE ...]"
    parser = _Parser(prog=prog, usage=usage, description=description or model.__doc__, formatter_class=HelpFormatter)
    parser.other_names = model.other_names
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML or TOML file with the settings below (snake_case keys)"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--check", action="store_true", help="validate the settings and exit without starting")
    _add_field_flags(parser, model, ())
    namespace, unknown = parser.parse_known_args(argv)
    args = vars(namespace)
    unknown = _take_passthrough(model, unknown, args)
    if unknown:
        parser.reject_unknown(unknown)
    file_path, print_config, check = args.pop("config"), args.pop("print_config"), args.pop("check")
    settings = read_config_file(file_path) if file_path else {}
    flags = {}
    for dotted, value in args.items():
        _set_path(flags, dotted.split("."), value)
    config = validate_config(model, _merge(settings, flags), set(args), str(file_path) if file_path else None)
    if print_config:  # without secrets (--redis-url redis://:PASSWORD@host, --api-key KEY)
        print(yaml.safe_dump(printable(config), sort_keys=False), end="")
        raise SystemExit(0)
    if check:
        print(f"{prog}: the settings are valid")
        raise SystemExit(0)
    return config


_NETLOC = re.compile(r"([^/?#]*)(.*)", re.DOTALL)  # a URL's authority (what precedes its path), and the rest
_SECRET_PARAMETER = re.compile(r"pass|pwd|secret|token|api[_-]?key|auth|signature", re.IGNORECASE)
_SECRET_FIELD = re.compile(r"(password|passwd|secret|token|api_key)$")  # a setting whose value is a secret
_SECRET_FLAG = re.compile(r"--[\w-]*(password|passwd|secret|token|api-key)")  # another program's (--sglang-api-key)


def redacted(url: str) -> str:
    """`url` without its password, for messages: redis://user:PASSWORD@host, user:PASSWORD@host (no scheme), and the
    values of secret query parameters (unix://…?password=PASSWORD, https://…?token=TOKEN)."""
    scheme, sep, rest = url.partition("://")
    head, rest = (scheme + sep, rest) if sep else ("", url)
    netloc, tail = _NETLOC.match(rest).groups()
    userinfo, _, host = netloc.rpartition("@")
    if ":" in userinfo:
        netloc = f"{userinfo.split(':')[0]}:***@{host}"
    path, question, query = tail.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        query = "&".join(_hidden_parameter(p) for p in query.split("&"))
        tail = f"{path}?{query}{hash_}{fragment}"
    return head + netloc + tail


def _hidden_parameter(parameter: str) -> str:
    name, equals, _ = parameter.partition("=")
    return f"{name}=***" if equals and _SECRET_PARAMETER.search(name) else parameter


def printable(config: BaseModel, **dump) -> dict:
    """A config's settings as plain data with no secret (for --print-config and the W&B run config): no URL's
    password, in any setting or list (a value may hold several URLs, separated by commas or spaces), no secret
    setting's value (the engine's --api-key), and no value of a secret option passed through to another program."""
    return _redact(_lifted(type(config), config.model_dump(mode="json", **dump)))


def flat_settings(config: BaseModel) -> dict[str, Any]:
    """The config's settings by their flat names (a flat group's fields in its place), as slime's `args` has them."""
    settings = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        settings.update(flat_settings(value) if name in _flat_groups(type(config)) else {name: value})
    return settings


def _lifted(model: type[BaseModel], data: dict) -> dict:
    """Dumped settings with each flat group's keys in the group's place, as a config file writes them."""
    out = {}
    for key, value in data.items():
        sub = _model_type(model.model_fields[key].annotation) if key in model.model_fields else None
        if sub is not None and sub.flat and isinstance(value, dict):
            out.update(_lifted(sub, value))
        elif sub is not None and isinstance(value, dict):
            out[key] = _lifted(sub, value)
        else:
            out[key] = value
    return out


def _redact(value: Any, name: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return _redact_options([_redact(v) for v in value])
    if isinstance(value, str):
        if value and _SECRET_FIELD.search(name.lower()):
            return "***"
        return re.sub(r"[^\s,]+", lambda word: redacted(word.group()), value)
    return value


def _redact_options(args: list) -> list:
    """`--api-key KEY` and `--api-key=KEY` in a list of another program's options, without the key."""
    shown = []
    for arg in args:
        secret_before = bool(shown) and isinstance(shown[-1], str) and _SECRET_FLAG.fullmatch(shown[-1])
        if secret_before and isinstance(arg, str) and not arg.startswith("--"):
            arg = "***"
        elif isinstance(arg, str) and "=" in arg and _SECRET_FLAG.fullmatch(arg.split("=")[0]):
            arg = arg.split("=")[0] + "=***"
        shown.append(arg)
    return shown


def _take_passthrough(model: type[StrictModel], unknown: list[str], args: dict) -> list[str]:
    """Moves options meant for another program (`model.passthrough`: flag prefix → list field, e.g. --sglang-*) into
    that field with the prefix removed; returns the arguments that are still unknown."""
    rest: list[str] = []
    target: list[str] | None = None
    for arg in unknown:
        prefix = next((p for p in getattr(model, "passthrough", {}) if arg.startswith(p)), None)
        if prefix is not None:
            target = args.setdefault(model.passthrough[prefix], [])
            target.append("--" + arg.removeprefix(prefix))
        elif target is not None and not arg.startswith("--"):
            target.append(arg)  # the value of the option before
        else:
            target = None
            rest.append(arg)
    return rest


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a flag in a help text stays whole (`--update-weight-disk-dir`, not `--update-weight-` and
    `disk-dir` on the next line)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = " ".join(text.split())
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")  # argparse's own misses the exponent


class _Parser(argparse.ArgumentParser):
    """Reports bad flags as one sentence (a ConfigError), with the closest valid flag when there is one."""

    other_names: dict[str, str] = {}  # the model's (StrictModel.other_names)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # `--lr -1e-3` is a value, as `--lr -0.001` is

    @property
    def help_command(self) -> str:
        """The command that lists these options: `slipstream train (trainer)`, the trainer's part of `slipstream
        train`, is no command; `slipstream train --help-all` lists every part's."""
        command, part, _ = self.prog.partition(" (")
        return f"{command} --help-all" if part else f"{self.prog} --help"

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message}; see `{self.help_command}`")

    def reject_unknown(self, unknown: list[str]) -> typing.NoReturn:
        flag = next((arg.split("=")[0] for arg in unknown if arg.startswith("-")), None)
        if flag is None:
            raise ConfigError(f"unexpected argument {unknown[0]!r}; settings are given as --name value")
        close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1)
        hint = f"did you mean {close[0]}?" if close else f"see `{self.help_command}` for the options"
        if flag in self.other_names:
            hint = f"{self.prog}'s is {self.other_names[flag]}"
        raise ConfigError(f"unknown option {flag}; {hint}")


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; check the path given to --config")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path}: unsupported format {path.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        detail = " ".join(str(e).split())
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not a {type(data).__name__}")
    return data


def validate_config(model: type[Config], data: dict[str, Any], flag_paths: set[str], file_name: str | None) -> Config:
    """Validates `data`; on failure raises one ConfigError with a sentence per bad field, naming where it came from."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = [_describe(model, err, flag_paths, file_name) for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def _describe(model: type[StrictModel], err: dict, flag_paths: set[str], file_name: str | None) -> str:
    err = {**err, "loc": _flat_loc(model, err["loc"])}
    path = ".".join(str(p) for p in err["loc"]) or "settings"  # a check across fields has no single field
    if err["loc"] and isinstance(err["loc"][-1], int) and path.rpartition(".")[0] in flag_paths:
        path = path.rpartition(".")[0]  # an item of a list: its flag's
    if path in flag_paths:
        source = "--" + path.replace(".", "-").replace("_", "-")
    else:
        source = f"{file_name}: {path}" if file_name else path
    if err["type"] == "extra_forbidden":
        valid = list(_fields_at(model, err["loc"][:-1]))
        close = difflib.get_close_matches(str(err["loc"][-1]).replace("-", "_"), valid, n=1)
        hint = f'did you mean "{close[0]}"?' if close else "remove it"
        return f"{source}: unknown setting; {hint} (valid here: {', '.join(valid)})"
    if err["type"] == "missing":
        return f"{source}: required setting is missing; add it to the config file or pass it as a flag"
    message = err["msg"].removeprefix("Value error, ")
    return f"{source}: {message}" if not err["loc"] else f"{source}: {message} (got {err['input']!r})"


def _flat_loc(model: type[StrictModel], loc: tuple) -> tuple:
    """An error's location as the user names it: without the flat groups (`loss.eps_clip` → `eps_clip`)."""
    names = []
    for part in loc:
        sub = _model_type(model.model_fields[part].annotation) if model and part in model.model_fields else None
        if sub is None or not sub.flat:
            names.append(part)
        model = sub
    return tuple(names)


def _fields_at(model: type[StrictModel], loc: tuple) -> dict:
    for part in loc:
        sub = _model_type(model.model_fields[part].annotation) if part in model.model_fields else None
        if sub is None:
            return {}
        model = sub
    fields = {}
    for name, field in model.model_fields.items():
        fields.update(_fields_at(model, (name,)) if name in _flat_groups(model) else {name: field})
    return fields


@dataclass(frozen=True)
class FieldFlag:
    """A setting as a flag: the trainer's `loss.eps_clip` is `--eps-clip` (a flat group's), listed under the
    algorithm section; `redis.url` is `--redis-url`, with the value at `path`."""

    flag: str
    path: tuple[str, ...]
    field: FieldInfo
    section: str
    owner: type  # the model that declares it (ServiceConfig for the server's settings, RunConfig for the run's facts)


def field_flags(
    model: type[StrictModel], prefix: tuple[str, ...] = (), groups: tuple[str, ...] = ()
) -> list[FieldFlag]:
    """The flag of every setting of `model`, in declaration order."""
    flags = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        sub = _model_type(field.annotation)
        if sub is not None:  # flat: its flags and keys are its own
            flags += field_flags(sub, prefix if sub.flat else path, (*groups, name))
        else:
            flag = "--" + "-".join(path).replace("_", "-")
            owner = next(c for c in model.__mro__ if name in vars(c).get("__annotations__", {}))
            flags.append(FieldFlag(flag, path, field, section_of(name, groups), owner))
    return flags


def _add_field_flags(parser: argparse.ArgumentParser, model: type[StrictModel], prefix: tuple[str, ...]) -> None:
    """One flag per setting, in argument groups by section (services/common/sections.py), so that `--help` reads
    model, data, rollout, … rather than one flat list."""
    flags = field_flags(model, prefix)
    used = {item.section for item in flags}
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items() if section in used}
    for item in flags:
        add_flag(groups[item.section], item)


def add_flag(group: argparse._ActionsContainer, item: FieldFlag, help_text: str | None = None) -> None:
    """Adds `item`'s flag to `group` (a parser or an argument group), with the field's help and default unless
    `help_text` replaces them."""
    field = item.field
    if help_text is None:
        shown = field.default not in (None, "", PydanticUndefined)
        help_text = (field.description or "") + (f" (default: {field.default})" if shown else "")
    kwargs: dict[str, Any] = {"dest": ".".join(item.path), "default": argparse.SUPPRESS}
    kwargs["metavar"] = item.path[-1].upper()
    kwargs["help"] = help_text.replace("%", "%%")
    kind = typing.get_origin(field.annotation) or field.annotation
    if field.annotation in (bool, bool | None):  # None: unset, for the service to choose
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind in (list, tuple, set):
        kwargs["nargs"] = "*"
    elif kind is Literal:
        kwargs["choices"] = typing.get_args(field.annotation)
        kwargs.pop("metavar")
    elif kind is dict:
        kwargs["type"] = _json_value
    else:
        kwargs["type"] = _scalar_value
    group.add_argument(item.flag, **kwargs)


def _scalar_value(text: str) -> str | None:
    return None if text.lower() in ("none", "null") else text


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}); pass an object like '{{\"key\": 1}}'") from None


def _set_path(target: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
