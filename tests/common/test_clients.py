"""Client helpers: calls to a service that is not up yet are retried with backoff on UNAVAILABLE; each call's deadline
is its own."""

import ast
import json
import threading
from pathlib import Path

import grpc
import pytest

from services.common.clients import channel_options, open_channel
from services.common.config import ServiceConfig
from services.common.server import Service, Servicer
from slipstream.v1 import buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2, trainer_pb2_grpc
from tests.python_source import parse

REPO = Path(__file__).resolve().parents[2]
PROTOS = (buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2)


async def build_plain(config):
    """A service whose servicer implements no RPC: it answers UNIMPLEMENTED once it is up."""
    return Service("plain", config, [Servicer.of(trainer_pb2_grpc.TrainerServiceServicer())])


def test_unavailable_is_retried_until_the_server_comes_up(grpc_service, free_port):
    port = free_port()
    config = ServiceConfig(host="127.0.0.1", port=port)
    starter = threading.Timer(0.5, lambda: grpc_service(build_plain, config, keep_port=True))
    with open_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        starter.start()
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
    starter.join()
    # UNIMPLEMENTED: the call reached the server that came up late instead of failing UNAVAILABLE.
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_without_a_server_the_caller_gets_unavailable(free_port):
    with open_channel(f"127.0.0.1:{free_port()}", max_attempts=2) as channel, pytest.raises(grpc.RpcError) as info:
        trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_channels_set_no_deadline_of_their_own():
    # gRPC takes the shorter of the service config's timeout and the call's: a channel-wide default would cut every
    # longer call short (an evaluation of a few minutes failed at 30 s this way).
    config = json.loads(dict(channel_options())["grpc.service_config"])
    assert all("timeout" not in method for method in config["methodConfig"])


def test_every_rpc_the_project_makes_passes_its_own_deadline():
    rpcs = {m.name for module in PROTOS for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods}
    missing = []
    for path in sorted(p for root in ("services", "slipstream", "examples") for p in (REPO / root).rglob("*.py")):
        for node in ast.walk(parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in rpcs
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")  # a servicer's own
                and not any(k.arg == "timeout" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.attr}")
    assert missing == []
