"""The transports by name, and each side's half of the one a sync takes. A new transport is a module beside these
(its `Gateway` and `Sender`, with its WeightTransport as `Gateway.kind`) and a line here."""

from services.common.errors import FailedPrecondition
from services.weightsync import broadcast, disk, handles, lora, streamed
from services.weightsync.halves import Gateway, Sender
from services.weightsync.protocol import Unreachable
from slipstream.v1 import rollout_pb2

UNSPECIFIED = rollout_pb2.WEIGHT_TRANSPORT_UNSPECIFIED  # a weight group: broadcast, or streamed where receivers are
TRANSPORTS = {module.Gateway.name: module for module in (broadcast, streamed, handles, disk, lora)}
AUTO = ("auto", "nccl")  # --update-weight-transport chosen from the run's other settings ("nccl": its old name)


def refusal(run, colocate: bool | None = None) -> str | None:
    """Why the run's weight-sync settings (services/common/run_facts.py) cannot work, or None: the rules the trainer
    and the gateway both apply as they load their settings (`colocate`: the trainer's; None on the gateway)."""
    transport, auto = run.update_weight_transport, run.update_weight_transport in AUTO
    if not auto and transport not in TRANSPORTS:
        return f"--update-weight-transport {transport}: not one of {', '.join([AUTO[0], *TRANSPORTS])}"
    if run.lora_rank and not (auto or transport == "lora"):
        return "--lora-rank sends the adapters as folders the engines load: --update-weight-transport lora (or auto)"
    if transport == "lora" and not run.lora_rank:
        return "--update-weight-transport lora sends LoRA adapters: add --lora-rank"
    half = None if auto else TRANSPORTS[transport].Gateway
    if run.update_weight_mode == "delta" and not (auto or half.takes_delta):
        takers = " or ".join(["auto", *(name for name, module in TRANSPORTS.items() if module.Gateway.takes_delta)])
        return f"--update-weight-mode delta: {transport} sends whole weights; use --update-weight-transport {takers}"
    if colocate and half is not None and half.uses_group:
        return (
            "--colocate hands the engines the trainer's tensors, not over a weight group: drop "
            f"--update-weight-transport {transport}"
        )
    if colocate is False and transport == "handles":
        return "--update-weight-transport handles hands the engines the trainer's tensors on its GPUs: add --colocate"
    return None


def by_kind(kind: int):
    """The module of the transport whose WeightTransport is `kind`, or None."""
    return next((module for module in TRANSPORTS.values() if module.Gateway.kind == kind), None)


def asked(config) -> int:
    """The WeightTransport a trainer's sync asks the gateway for: LoRA's, the one --update-weight-transport names, or
    colocated the handles; for a weight group (auto) unspecified, where the gateway picks broadcast or streamed."""
    if config.lora_rank:
        return rollout_pb2.WEIGHT_TRANSPORT_LORA
    if config.update_weight_transport in TRANSPORTS:  # refusal() held it to one that works with the rest
        return TRANSPORTS[config.update_weight_transport].Gateway.kind
    if config.colocate:
        return rollout_pb2.WEIGHT_TRANSPORT_HANDLES
    return UNSPECIFIED


def gateway_half(asked: int, engines: list, config, adapters=None) -> Gateway:
    """The gateway's half of what the trainer `asked` (a WeightTransport), which it confirms with its own settings:
    for a weight group (unspecified), the receivers' streamed path where the gateway has them, else broadcast."""
    if asked == UNSPECIFIED:
        module = streamed if config.weight_receiver_port_offset is not None else broadcast
    elif (module := by_kind(asked)) is None:
        raise FailedPrecondition(f"the trainer asks for weight transport {asked}, which this gateway does not know")
    return module.Gateway.of(config, engines, adapters)


def sender_half(sender, prepared, version: int, requests, responses, watchdog) -> Sender:
    """The trainer's half of the transport the gateway chose (PrepareWeightSyncResponse.transport)."""
    if (module := by_kind(prepared.transport)) is None:
        raise Unreachable(f"the gateway chose weight transport {prepared.transport}, which this trainer does not know")
    if sender.config.update_weight_mode == "delta" and not module.Gateway.takes_delta:
        raise Unreachable(
            "--update-weight-mode delta needs a weight receiver beside each engine: start the gateway "
            "with --weight-receiver-port-offset (docs/rollout.md, 'Streamed weight sync')"
        )
    half = module.Sender
    sender.kept = {half: sender.kept.get(half)}  # another half's leftovers go
    taken = half(sender, prepared, version, requests, responses, watchdog)
    taken.name = module.Gateway.name
    return taken
