"""The arguments of `slipstream train`, in slime's three categories: Megatron's (to the trainer), `--sglang-*` (to the
engines, through the gateway) and slime's own. Each flag has one owner, the config model that declares it: a
service's own flag goes to that service, a run fact (services/common/run_facts.py: `--rollout-batch-size`,
`--rm-type`) to every service, the launcher's own (TrainOptions) to the launcher; so every service validates its own
part and the names are the services' own."""

import difflib
import importlib.util
import logging
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, SecretStr, model_validator

from services.buffer import preflight as buffer_preflight
from services.buffer.config import BufferConfig
from services.buffer.datasets import DatasetError, dataset_files, parse_spec
from services.common.config import ConfigError, ServiceConfig, StrictModel, field_flags, load_config
from services.reward import preflight as reward_preflight
from services.reward.config import RewardConfig
from services.rollout import preflight as rollout_preflight
from services.rollout import sglang_options
from services.rollout.config import RolloutConfig
from services.train.refused import REFUSED
from services.trainer import preflight as trainer_preflight
from services.trainer.batching import BatchSizeError
from services.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


class TrainOptions(StrictModel):
    """slime's own options that no single service has; the services' options are accepted too. Given, the services'
    --buffer-addr, --reward-addr (the gateway's) and --rollout-addr (the trainer's) join a running service instead of
    starting one; the run's folder is the buffer's, <--output-dir>/<--run-id>."""

    actor_num_nodes: int = Field(1, ge=1, le=1)
    """Trainer nodes; `slipstream train` starts one node (on a cluster, run `slipstream trainer` under torchrun on
    each node and join it with --buffer-addr / --rollout-addr)."""
    actor_num_gpus_per_node: int = Field(1, ge=1)
    """Trainer ranks (torchrun --nproc-per-node); on CPU, processes."""
    async_buffer_size: int = Field(0, ge=0)
    """Staleness bound k: a step may train samples of policies up to k versions old (0: synchronous as slime's
    train.py; 1: one step of overlap as train_async.py). Sets the buffer's --max-staleness."""
    eval_interval: int | None = Field(None, ge=1)
    """Evaluate every eval set every this many steps (and at the start and the end)."""
    use_fault_tolerance: bool = False
    """Accepted for slime's scripts: the services always evict failing engines and re-admit them once healthy."""
    debug_rollout_only: bool = False
    """Generate and score rollouts without a trainer (each step's batch is taken and committed as if trained)."""
    debug_train_only: bool = False
    """Train without engines on the batches saved by --save-debug-rollout-data (--load-debug-rollout-data)."""
    save_debug_rollout_data: str | None = None
    """Save each step's batch to this path (with {rollout_id}), e.g. runs/x/rollout_{rollout_id}.pb."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long each service may take to start (engines load the model)."""
    stall_timeout_s: float = Field(1800.0, ge=0)
    """Stop the run when nothing progresses for this long (no step, no weight sync, no sample generated or
    consumed), saying which part stalled and its last error; 0 waits forever."""
    log_level: str = "info"
    """Log level of the services (their logs are under <run>/logs)."""
    use_wandb: bool = False
    """Log the run to W&B (the wandb package): every step's metrics under slime's names, the evaluations and every
    service's settings (docs/train.md, "W&B")."""
    wandb_project: str | None = None
    """W&B project."""
    wandb_team: str | None = None
    """W&B entity (team or user)."""
    wandb_group: str | None = None
    """W&B group; also the run's name (default: --run-id)."""
    wandb_host: str | None = None
    """W&B server, for a self-hosted one."""
    wandb_key: SecretStr | None = None
    """W&B API key (or WANDB_API_KEY in the environment, which keeps it out of `ps`); never printed or logged."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """online (W&B's default), offline (files only: `wandb sync` later) or disabled."""
    wandb_dir: Path | None = None
    """Folder of the W&B files; default the run folder."""
    wandb_run_id: str | None = None
    """Log into this W&B run; default: the run folder's (kept in <run>/wandb-run-id), or a new one."""
    host: str = "127.0.0.1"
    """Address the services it starts listen on (gRPC and metrics). The default keeps them on this machine; another
    (0.0.0.0: every interface) opens them to the network: add --tls-cert-file/--tls-key-file (docs/SECURITY.md)."""

    @model_validator(mode="after")
    def _check(self) -> "TrainOptions":
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("--debug-rollout-only and --debug-train-only exclude each other")
        if self.save_debug_rollout_data and "{rollout_id}" not in self.save_debug_rollout_data:
            raise ValueError("--save-debug-rollout-data needs {rollout_id} in the path, e.g. rollout_{rollout_id}.pb")
        return self


SERVICES = {"buffer": BufferConfig, "reward": RewardConfig, "rollout": RolloutConfig, "trainer": TrainerConfig}
PREFLIGHT = {
    "buffer": buffer_preflight.check,
    "reward": reward_preflight.check,
    "rollout": rollout_preflight.check,
    "trainer": trainer_preflight.check,
}
# Set by `slipstream train` for each service it starts.
OWN = {
    "host",
    "port",
    "metrics_port",
    "grace_period_s",
    "max_message_mb",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "steps_file",
    "engine_log_dir",
    "log_level",
}
_SHAPE = "the model's shape is read from --hf-checkpoint's config.json"
# Flags of slime's scripts that are accepted and ignored, with the reason (said in a warning).
IGNORED = {
    **{flag: _SHAPE for flag in (
        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
        "--num-query-groups", "--kv-channels", "--swiglu", "--normalization", "--norm-epsilon", "--rotary-base",
        "--use-rotary-position-embeddings", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--vocab-size", "--qk-layernorm", "--position-embedding-type", "--add-qkv-bias", "--seq-length",
        "--max-position-embeddings", "--make-vocab-size-divisible-by", "--attention-dropout", "--hidden-dropout",
        "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--attention-backend",
        # MoE and multi-latent attention (families/ read them from config.json)
        "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
        "--moe-router-pre-softmax", "--moe-router-score-function", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk", "--moe-layer-freq",
        "--moe-router-dtype", "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
        "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
        "--rotary-percent", "--rotary-interleaved", "--post-self-attn-layernorm", "--post-mlp-layernorm",
        "--rope-type", "--original-max-position-embeddings", "--beta-fast", "--beta-slow",
    )},
    "--moe-grouped-gemm": "the experts run as grouped GEMMs (torch's own op) wherever Transformer Engine and "
                          "grouped_gemm are absent (services/trainer/grouped_experts.py)",
    **{flag: "the trainer picks megatron's MoE kernels (all-to-all dispatch)"
       for flag in ("--moe-token-dispatcher-type", "--moe-permute-fusion",
                    "--moe-shared-expert-overlap", "--moe-router-fusion", "--no-rope-fusion")},
    "--optimizer": "the optimizer is AdamW (Megatron's)",
    "--megatron-to-hf-mode": "weights are converted to HF names by the trainer itself",
    "--ref-load": "the reference model is --hf-checkpoint's weights",
    "--disable-wandb-random-suffix": "the W&B run's name is --wandb-group or --run-id, with no random suffix",
    "--wandb-always-use-train-step": "a step trains one rollout: train/step and rollout/step are the same",
}  # fmt: skip
# Flags accepted only at their neutral value, with the reason.
NEUTRAL = {
    "--context-parallel-size": (
        "1",
        "context parallelism is not built: megatron-core runs it only in Transformer "
        "Engine's attention, and this trainer's is SDPA (docs/ARGUMENTS.md)",
    ),
    "--moe-router-bias-update-rate": (
        "0",
        "the routers' expert-score corrections stay the checkpoint's, as the engines' do",
    ),
}
RECOMPUTE = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")  # → --recompute-activations


JOIN = {"buffer": "--buffer-addr", "reward": "--reward-addr", "rollout": "--rollout-addr"}  # given: join, not start


@dataclass
class Plan:
    """What `slipstream train` starts: its own options, and each service's arguments and validated config."""

    options: TrainOptions
    argv: dict[str, list[str]] = field(default_factory=dict)
    configs: dict[str, ServiceConfig] = field(default_factory=dict)
    joined: dict[str, str] = field(default_factory=dict)  # the running services it joins: name -> address

    @property
    def run_dir(self) -> Path:
        return self.configs["buffer"].run_dir


def takers(parts: dict[str, type[StrictModel]]) -> dict[str, list[str]]:
    """The parts (services, "train") that take each flag: those whose config holds the model that declares it. A flag
    two models declare fails here, before any run: it would mean two things, or go where it is read as another."""
    owners: dict[str, type] = {}
    found: dict[str, list[str]] = {}
    for name, model in parts.items():
        for item in field_flags(model):
            if item.path[-1] in OWN and model is not TrainOptions:
                continue  # set by the launcher for each service it starts
            if owners.setdefault(item.flag, item.owner) is not item.owner:
                raise TypeError(
                    f"{item.flag} is declared by {owners[item.flag].__name__} and {item.owner.__name__}: a setting "
                    "has one owner (one that several services take is a run fact: services/common/run_facts.py)"
                )
            negated = [f"--no-{item.flag[2:]}"] if item.field.annotation is bool else []  # BooleanOptionalAction's
            for flag in (item.flag, *negated):
                found.setdefault(flag, []).append(name)
    return found


def route(argv: list[str]) -> dict[str, list[str]]:
    """Each service's flags (and the launcher's own, under "train") from a `slipstream train` command line, with what
    only the launcher knows: slime's `--async-buffer-size k` (the buffer's `--max-staleness k`), a LoRA run's adapter
    folder in its run folder, and its --debug-rollout-only mode. Rules between the services' settings are not made
    here but in their configs, which every way of starting a service applies (services/weightsync/factory.py)."""
    flags = takers({**SERVICES, "train": TrainOptions})
    routed: dict[str, list[str]] = {name: [] for name in [*SERVICES, "train"]}
    ignored = []
    for chunk in _chunks(argv):
        flag, values = chunk[0].split("=")[0], [*chunk[0].split("=")[1:], *chunk[1:]]
        if flag.startswith("--sglang-"):
            if "rollout" not in flags.get(flag, []):  # the gateway's own --sglang-server-concurrency aside: SGLang's
                sglang_options.check(flag)
            routed["rollout"] += chunk
        elif flag in IGNORED:
            ignored.append(f"{flag} ({IGNORED[flag]})")
        elif flag in NEUTRAL:
            neutral, reason = NEUTRAL[flag]
            if not _is_number(values, float(neutral)):
                raise ConfigError(f"{flag} {' '.join(values)}: only {neutral} is supported ({reason})")
        elif flag in REFUSED:
            raise ConfigError(f"{flag} (slime's) is not taken here: {REFUSED[flag]} (docs/ARGUMENTS.md)")
        elif flag in RECOMPUTE:
            if flag == "--recompute-granularity" and values != ["selective"]:
                routed["trainer"].append("--recompute-activations")
        else:
            names = flags.get(flag, [])
            if not names:
                everything = sorted({*flags, *IGNORED})
                close = difflib.get_close_matches(flag, everything, n=1)
                hint = f"did you mean {close[0]}?" if close else "see `slipstream train --help-all`, docs/ARGUMENTS.md"
                raise ConfigError(f"unknown option {flag}; {hint}")
            for name in names:
                routed[name] += chunk
    for item in ignored:
        log.warning("ignored %s", item)
    options = load_config(TrainOptions, routed["train"], prog="slipstream train")
    if options.async_buffer_size:
        routed["buffer"] += ["--max-staleness", str(options.async_buffer_size)]
    lora = _value(argv, "--lora-rank") not in (None, "0")
    if lora and _value(argv, "--update-weight-disk-dir") is None and not _value(argv, "--rollout-addr"):
        run_dir = Path(_value(argv, "--output-dir") or "runs") / (_value(argv, "--run-id") or "default")
        folder = str((run_dir / "adapters").resolve())  # the engines it launches read the adapters there
        routed["trainer"] += ["--update-weight-disk-dir", folder]
        routed["rollout"] += ["--update-weight-disk-dir", folder]
    if options.debug_rollout_only:  # the engines keep their weights: no group may be dropped as stale
        routed["buffer"] += ["--stale-policy", "mark"]
    return routed


def parse(argv: list[str]) -> Plan:
    """Routes every flag to the services that know it and validates each service's config before anything starts."""
    routed = route(argv)
    plan = Plan(load_config(TrainOptions, routed.pop("train"), prog="slipstream train"))
    plan.joined = {name: address for name, flag in JOIN.items() if (address := _value(argv, flag))}
    # Here, not in TrainOptions: a service reading the launcher's flags (@run.flags) has no wandb and needs none.
    if plan.options.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--use-wandb needs the wandb package: pip install wandb")
    # Checked with the addresses the launcher will add, so that what needs them (--colocate) is judged as it will run.
    started = {"rollout": ["--reward-addr", "launched:0"], "trainer": ["--buffer-addr", "launched:0"]}
    given = ("--engine-urls", "--rollout-num-gpus", "--rollout-addr")
    if not any(_value(argv, flag) for flag in given) and _value(argv, "--hf-checkpoint"):
        routed["rollout"] += ["--rollout-num-gpus", "1"]  # the gateway it starts launches one engine
    if not plan.options.debug_train_only:
        started["trainer"] += ["--rollout-addr", "launched:0"]
    for name, model in SERVICES.items():
        plan.argv[name] = routed[name]
        plan.configs[name] = load_config(model, started.get(name, []) + routed[name], prog=f"slipstream train ({name})")
    _check_together(plan)
    for name, check in PREFLIGHT.items():  # what each service it starts would find at its start (a joined one: its own)
        if name not in plan.joined:
            check(plan.configs[name])
    return plan


def _check_together(plan: Plan) -> None:
    """What no single service can see: slime's batch constraint first, then settings that must agree."""
    buffer, trainer, rollout = plan.configs["buffer"], plan.configs["trainer"], plan.configs["rollout"]
    options, joined = plan.options, plan.joined
    if not (buffer.prompt_data or buffer.data_source_path or "buffer" in joined or options.debug_train_only):
        raise ConfigError("--prompt-data is required: the training prompts (.jsonl or .parquet)")
    if not trainer.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required: the HF model folder to start from")
    if rollout.engine_urls and rollout.rollout_num_gpus:
        raise ConfigError("--engine-urls uses running engines; drop --rollout-num-gpus, which starts new ones")
    if trainer.save_interval and not trainer.save:  # here: a run file for containers leaves --save to each job
        raise ConfigError("--save-interval saves checkpoints into --save: add --save DIR, or drop it")
    if options.eval_interval and not (buffer.eval_sets() or "buffer" in joined):
        raise ConfigError("--eval-interval evaluates the eval sets: add --eval-prompt-data NAME PATH, or drop it")
    if options.save_debug_rollout_data and not options.debug_rollout_only:
        raise ConfigError("--save-debug-rollout-data is written by --debug-rollout-only runs")
    if options.debug_train_only and not trainer.load_debug_rollout_data:
        raise ConfigError("--debug-train-only trains on saved batches: pass --load-debug-rollout-data PATH")
    _check_ranks(options, trainer)
    if "buffer" not in joined:
        _check_files(buffer, trainer)


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # "Qwen/Qwen3-0.6B": transformers fetches it


def _check_files(buffer: BufferConfig, trainer: TrainerConfig) -> None:
    """The model folder and the data files, before any service starts (each would stop its service, one by one)."""
    model = Path(trainer.hf_checkpoint)
    if not model.exists() and (_looks_local(trainer.hf_checkpoint) or not HUB_ID.match(trainer.hf_checkpoint)):
        raise ConfigError(
            f"--hf-checkpoint {model}: no such folder; pass the folder of an HF checkpoint "
            "(config.json, the weights and the tokenizer), or a Hub id (org/name), which needs the network"
        )
    if model.is_dir() and not (model / "config.json").exists():
        raise ConfigError(
            f"--hf-checkpoint {model} has no config.json; pass the folder of an HF checkpoint "
            "(config.json, the weights and the tokenizer)"
        )
    if not model.exists() and (why := _hub_unreachable(trainer.hf_checkpoint)):
        raise ConfigError(
            f"--hf-checkpoint {model}: no such folder, and as a Hub id it is not in this machine's Hugging Face cache "
            f"and {why}; download it where there is a network (`huggingface-cli download {model} --local-dir DIR`) "
            "and pass that folder"
        )
    specs = [("--prompt-data", buffer.prompt_data)] if buffer.prompt_data else []
    source = "--eval-config" if buffer.eval_config else "--eval-prompt-data"
    specs += [(source, eval_set.path) for eval_set in buffer.eval_sets()]
    for flag, spec in specs:
        try:
            dataset_files(parse_spec(spec)[0])
        except DatasetError as e:
            raise ConfigError(f"{flag} {spec}: {e}") from None


def check_joined(plan: Plan, timeout_s: float = 5.0) -> None:
    """`--check`: each running service the run joins takes a connection and answers its health check (which needs
    no token), each within `timeout_s`. A host name that does not resolve here is only reported: a deployment's
    command lines are checked where its names mean nothing yet (a start asks again)."""
    import grpc

    from services.common.clients import Credentials, health_status, open_channel

    for name, address in plan.joined.items():
        host, _, port = address.rpartition(":")
        fix = f"start it there, or drop {JOIN[name]} and the run starts its own"
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        except socket.gaierror:
            log.warning("%s %s: %s does not resolve here, so it is not checked", JOIN[name], address, host)
            continue
        except (OSError, ValueError) as e:
            reason = "no answer" if isinstance(e, TimeoutError) else getattr(e, "strerror", None) or str(e)
            raise ConfigError(f"{JOIN[name]} {address}: no {name} service there ({reason}); {fix}") from None
        with open_channel(address, Credentials(plan.configs["buffer"].tls), max_attempts=1) as channel:
            try:
                health_status(channel, timeout_s=timeout_s)
            except grpc.RpcError as e:
                raise ConfigError(
                    f"{JOIN[name]} {address}: something takes connections there, but no {name} service answers its "
                    f"health check ({e.code().name}; hung, or not a slipstream service); {fix}"
                ) from None


def _hub_unreachable(hub_id: str, timeout_s: float = 4.0) -> str | None:
    """Why the Hub cannot give `hub_id` now, or None: it is cached, or the Hub takes a connection within
    `timeout_s` (name resolution included)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    failed: list[str] = ["no answer"]

    def connect() -> None:
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
            failed.clear()
        except OSError as e:
            failed[0] = getattr(e, "strerror", None) or str(e)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s)
    return f"{endpoint.hostname} cannot be reached from here ({failed[0]})" if failed else None


def _looks_local(path: str) -> bool:
    """A path meant as a folder here, not a Hub id: absolute, relative (./, ../, ~) or under a folder that exists
    (`runs/modle`: a typo of `runs/model`, which the Hub would be asked for, and fail to give, a minute later)."""
    return path.startswith(("/", ".", "~")) or ("/" in path and Path(path).expanduser().parent.is_dir())


def _check_ranks(options: TrainOptions, trainer: TrainerConfig) -> None:
    """The trainer's data-parallel size is known only here (ranks / TP / PP): the batch sizes are checked with it, as
    each rank will check them, so that a bad combination stops before anything starts."""
    layout = trainer.parallel
    ranks, model_parallel = options.actor_num_gpus_per_node, layout.tensor_model_parallel_size
    model_parallel *= layout.pipeline_model_parallel_size
    if ranks % model_parallel:
        raise ConfigError(
            f"--actor-num-gpus-per-node {ranks} is not a multiple of --tensor-model-parallel-size "
            f"times --pipeline-model-parallel-size = {model_parallel}"
        )
    experts = layout.expert_model_parallel_size * (
        layout.expert_tensor_parallel_size or layout.tensor_model_parallel_size
    )
    experts *= layout.pipeline_model_parallel_size
    if ranks % experts:
        raise ConfigError(
            f"--actor-num-gpus-per-node {ranks} is not a multiple of --expert-model-parallel-size "
            f"x --expert-tensor-parallel-size x --pipeline-model-parallel-size = {experts}"
        )
    try:
        trainer.batch_sizes(ranks // model_parallel).check()
    except BatchSizeError as e:
        dp = ranks // model_parallel
        raise ConfigError(f"{e} (the trainer's {ranks} rank(s) make a data-parallel size of {dp})") from None


def _value(argv: list[str], flag: str) -> str | None:
    """The last value given to `flag` (`--flag v` or `--flag=v`), or None."""
    found = None
    for chunk in _chunks(argv):
        name, *inline = chunk[0].split("=", 1)
        if name == flag:
            found = " ".join(inline + chunk[1:])
    return found


def _is_number(values: list[str], number: float) -> bool:
    try:
        return len(values) == 1 and float(values[0]) == number
    except ValueError:
        return False


def _flags(model: type[StrictModel]) -> set[str]:
    """The flags `model` takes from `slipstream train` (not those the launcher sets for each service)."""
    return set(takers({"part": model}))


def _chunks(argv: list[str]) -> list[list[str]]:
    """Splits the command line into [flag, values…] chunks."""
    chunks: list[list[str]] = []
    for arg in argv:
        is_value = not arg.startswith("--") or arg == "--"
        if is_value:
            if not chunks:
                raise ConfigError(f"unexpected argument {arg!r}; settings are given as --name value")
            chunks[-1].append(arg)
        else:
            chunks.append([arg])
    return chunks
