"""Token files, the role table, and certificates and tokens renewed on disk while a real service runs."""

import os
import shutil

import grpc
import pytest

from services.common.auth import CALLERS, TokenFile
from services.common.clients import Credentials, open_aio_channel
from services.common.config import TlsConfig
from services.common.errors import StartupError
from slipstream.v1 import buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2
from tests.certs import make_ca, make_leaf
from tests.security.test_secured_run import CALLS
from tests.security.test_secured_run import code_of as call_code

LIST_REWARD_FUNCTIONS = CALLS["reward"][0]


def test_every_method_in_the_role_table_is_an_rpc_of_a_service():
    methods = {f"/{service.full_name}/{method.name}" for module in (buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2)
               for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods}  # fmt: skip
    assert set(CALLERS) <= methods, set(CALLERS) - methods
    admin_only = sorted(m.rsplit("/", 1)[1] for m in methods - set(CALLERS))
    assert admin_only == ["DeregisterEngine", "RegisterEngine", "SaveCheckpoint", "Stop"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "holds no `role token` line"),
        ("# only a comment\n", "holds no `role token` line"),
        (
            "reader abcdefghijklmnopqrstuvwxyz\n",
            "line 1: expected `role token` with role one of worker, trainer, admin",
        ),
        ("admin abcdefghijklmnopqrstuvwxyz\nworker\n", "line 2: expected `role token`"),
        ("worker short\n", "line 1: the token is shorter than 16 characters"),
    ],
)
def test_a_bad_token_file_is_one_sentence_naming_the_line(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(StartupError, match=message.replace("`", ".").replace("(", ".")):
        TokenFile(path)


def test_a_call_needing_a_role_the_file_lacks_falls_back_to_admin_else_is_refused_at_start(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("admin " + "a" * 20 + "\n")
    assert TokenFile(path).token_for("worker") == "a" * 20
    path.write_text("trainer " + "t" * 20 + "\n")
    with pytest.raises(StartupError, match=r"has no token of role 'worker' \(or admin\)"):
        TokenFile(path).token_for("worker")


def code_of(address: str, credentials: Credentials) -> grpc.StatusCode:
    return call_code(LIST_REWARD_FUNCTIONS, address, credentials)


@pytest.mark.timeout(120)
def test_a_renewed_certificate_and_rotated_tokens_take_effect_without_a_restart(
    service_process, wait_serving, free_port, tmp_path
):
    certs = tmp_path / "certs"
    ca, ca_key = make_ca(certs)
    first = make_leaf(certs, "first", ca, ca_key)
    new_ca, new_key = make_ca(certs, "new")
    renewed = make_leaf(certs, "renewed", new_ca, new_key)
    served = certs / "served"
    served.mkdir()
    shutil.copy(first.cert, served / "tls.crt")
    shutil.copy(first.key, served / "tls.key")
    tokens = tmp_path / "tokens"
    tokens.write_text("worker old-token-" + "o" * 16 + "\n")
    port = free_port()
    proc = service_process("reward", "--host", "127.0.0.1", "--port", str(port), "--tls-cert-file",
                           str(served / "tls.crt"), "--tls-key-file", str(served / "tls.key"), "--tls-ca-file",
                           str(ca.cert), "--auth-token-file", str(tokens))  # fmt: skip
    address = f"127.0.0.1:{port}"
    # Clients present a certificate of the first CA (the server's client CA); they trust one CA or the other.
    trusts_first = TlsConfig(cert_file=first.cert, key_file=first.key, ca_file=ca.cert)
    trusts_new = TlsConfig(cert_file=first.cert, key_file=first.key, ca_file=new_ca.cert)
    shutil.copy(tokens, tmp_path / "old-client")  # what a client not yet given the new token holds
    old = TokenFile(tmp_path / "old-client")
    wait_serving_tls(address, proc, Credentials(trusts_first, old, "worker"))
    assert code_of(address, Credentials(trusts_new, old, "worker")) == grpc.StatusCode.UNAVAILABLE

    os.replace(renewed.cert, served / "tls.crt.new")  # replaced as a whole, as a Secret update does
    os.replace(renewed.key, served / "tls.key.new")
    os.replace(served / "tls.key.new", served / "tls.key")
    os.replace(served / "tls.crt.new", served / "tls.crt")
    assert code_of(address, Credentials(trusts_new, old, "worker")) == grpc.StatusCode.OK
    assert code_of(address, Credentials(trusts_first, old, "worker")) == grpc.StatusCode.UNAVAILABLE

    rotated = tmp_path / "rotated"
    rotated.write_text("worker new-token-" + "n" * 16 + "\n")
    shutil.copy(rotated, tmp_path / "new-client")
    new = TokenFile(tmp_path / "new-client")
    os.replace(rotated, tokens)
    assert code_of(address, Credentials(trusts_new, old, "worker")) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(address, Credentials(trusts_new, new, "worker")) == grpc.StatusCode.OK
    assert "TLS certificate re-read" in proc.log and proc.proc.poll() is None


def wait_serving_tls(address: str, proc, credentials: Credentials) -> None:
    from services.common.clients import wait_until_serving

    try:
        wait_until_serving(address, 60, credentials=credentials)
    except TimeoutError:
        pytest.fail(f"{address} never served:\n{proc.log}")


async def test_an_asyncio_channel_sends_the_token_on_every_kind_of_call(tmp_path):
    """grpc.aio files an interceptor under one kind of call only: a gateway forwarding a trainer's bucket stream to
    the coordinator sent it without a token until each kind had its own."""
    path = tmp_path / "tokens"
    path.write_text("trainer " + "t" * 32 + "\n")
    path.chmod(0o600)

    class Echo(grpc.GenericRpcHandler):  # answers with the authorization metadata it got
        def service(self, details):
            async def unary(request, context):
                return dict(context.invocation_metadata()).get("authorization", "none").encode()

            async def stream(requests, context):
                async for _ in requests:
                    yield dict(context.invocation_metadata()).get("authorization", "none").encode()

            async def stream_in(requests, context):
                return [r async for r in requests] and await unary(None, context)

            async def stream_out(request, context):
                yield await unary(request, context)

            kinds = {"uu": grpc.unary_unary_rpc_method_handler(unary), "ss": grpc.stream_stream_rpc_method_handler(
                stream), "su": grpc.stream_unary_rpc_method_handler(stream_in),
                "us": grpc.unary_stream_rpc_method_handler(stream_out)}  # fmt: skip
            return kinds[details.method.rsplit("/", 1)[1]]

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([Echo()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    credentials = Credentials(TlsConfig(), TokenFile(path), "trainer")
    channel = open_aio_channel(f"127.0.0.1:{port}", credentials)
    try:
        expected = ("Bearer " + "t" * 32).encode()
        assert await channel.unary_unary("/e/uu")(b"x") == expected
        assert [r async for r in channel.unary_stream("/e/us")(b"x")] == [expected]
        assert await channel.stream_unary("/e/su")(iter([b"x"])) == expected
        assert [r async for r in channel.stream_stream("/e/ss")(iter([b"x"]))] == [expected]
    finally:
        await channel.close()
        await server.stop(None)
