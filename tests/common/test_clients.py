"""Client helpers: calls to a service that is not up yet are retried with backoff on UNAVAILABLE."""

import threading

import grpc
import pytest

from services.common.clients import open_channel
from services.common.config import ServiceConfig
from services.common.server import Service, Servicer
from slipstream.v1 import trainer_pb2, trainer_pb2_grpc


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
