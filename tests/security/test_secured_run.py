"""A whole `slipstream train` run with TLS, mutual TLS and role tokens: every service a real process, every client
(launcher, gateway, trainer) calling through them, and every service refusing strangers."""

import re
import signal
from pathlib import Path

import grpc
import pytest

from services.common.auth import TokenFile
from services.common.clients import Credentials, open_channel
from services.common.config import TlsConfig
from services.train.demo import train_args
from slipstream.v1 import (
    buffer_pb2,
    buffer_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.certs import make_ca, make_leaf
from tests.test_train import wait_gone, wait_steps

TOKENS = {role: f"{role}-token-{'x' * 16}" for role in ("worker", "trainer", "admin")}

# Per service: a call open to every role, and a call the worker or trainer role may not make.
CALLS = {
    "buffer": (
        lambda ch: buffer_pb2_grpc.BufferServiceStub(ch).GetState(buffer_pb2.GetStateRequest(), timeout=10),
        lambda ch: buffer_pb2_grpc.BufferServiceStub(ch).Rewind(buffer_pb2.RewindRequest(step=0), timeout=10),
    ),
    "reward": (
        lambda ch: reward_pb2_grpc.RewardServiceStub(ch).ListRewardFunctions(
            reward_pb2.ListRewardFunctionsRequest(), timeout=10
        ),
        lambda ch: reward_pb2_grpc.RewardServiceStub(ch).Score(reward_pb2.ScoreRequest(), timeout=10),
    ),
    "rollout": (
        lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10),
        lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).RegisterEngine(
            rollout_pb2.RegisterEngineRequest(url="http://127.0.0.1:1"), timeout=10
        ),
    ),
    "trainer": (
        lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).GetStatus(trainer_pb2.GetStatusRequest(), timeout=10),
        lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).Stop(trainer_pb2.StopRequest(), timeout=10),
    ),
}
# The role that may not make each service's second call.
WRONG_ROLE = {"buffer": "worker", "reward": "trainer", "rollout": "worker", "trainer": "trainer"}


def addresses(run_dir: Path) -> dict[str, str]:
    found = {}
    for name in CALLS:
        match = re.search(r"serving on (\S+:\d+)", (run_dir / "logs" / f"{name}.log").read_text())
        found[name] = match.group(1)
    return found


def code_of(call, address: str, credentials: Credentials) -> grpc.StatusCode:
    with open_channel(address, credentials, max_attempts=1) as channel:
        try:
            call(channel)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


@pytest.mark.timeout(600)
def test_with_tls_and_tokens_the_run_trains_and_every_service_refuses_strangers(service_process, tmp_path):
    certs = tmp_path / "certs"
    ca, ca_key = make_ca(certs)
    service = make_leaf(certs, "service", ca, ca_key)
    other_ca, other_key = make_ca(certs, "other")
    stranger = make_leaf(certs, "stranger", other_ca, other_key)
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{role} {token}\n" for role, token in TOKENS.items()))
    security = ["--tls-cert-file", str(service.cert), "--tls-key-file", str(service.key), "--tls-ca-file",
                str(ca.cert), "--auth-token-file", str(token_file)]  # fmt: skip
    run = service_process("train", *train_args(tmp_path, steps=100), *security)
    run_dir = tmp_path / "demo"
    wait_steps(run, run_dir, 2)  # launcher, gateway and trainer called every service over mutual TLS with tokens
    assert not (run_dir / "auth-tokens").exists()  # the given token file is used, none generated

    tls = TlsConfig(cert_file=service.cert, key_file=service.key, ca_file=ca.cert)
    tokens = TokenFile(token_file)
    plaintext = Credentials(TlsConfig(), tokens, "admin")
    foreign = Credentials(TlsConfig(cert_file=stranger.cert, key_file=stranger.key, ca_file=ca.cert), tokens, "admin")
    for name, address in addresses(run_dir).items():
        read, restricted = CALLS[name]
        assert code_of(read, address, Credentials(tls, tokens, "worker")) == grpc.StatusCode.OK, name
        assert code_of(read, address, Credentials(tls)) == grpc.StatusCode.UNAUTHENTICATED, name
        assert code_of(read, address, plaintext) == grpc.StatusCode.UNAVAILABLE, name
        assert code_of(read, address, foreign) == grpc.StatusCode.UNAVAILABLE, name  # no client certificate of the CA
        wrong = Credentials(tls, tokens, WRONG_ROLE[name])
        assert code_of(restricted, address, wrong) == grpc.StatusCode.PERMISSION_DENIED, name
        assert "refused /slipstream.v1." in (run_dir / "logs" / f"{name}.log").read_text(), name

    run.proc.send_signal(signal.SIGINT)
    assert run.wait(120) == 130
    assert wait_gone(run_dir) == []


@pytest.mark.timeout(600)
def test_with_no_flags_the_services_listen_on_localhost_and_need_the_runs_generated_token(service_process, tmp_path):
    run = service_process("train", *train_args(tmp_path, steps=100))
    run_dir = tmp_path / "demo"
    wait_steps(run, run_dir, 1)
    token_file = run_dir / "auth-tokens"
    assert token_file.stat().st_mode & 0o777 == 0o600
    tokens = TokenFile(token_file)
    for name, address in addresses(run_dir).items():
        assert address.startswith("127.0.0.1:"), name
        read, _ = CALLS[name]
        assert code_of(read, address, Credentials()) == grpc.StatusCode.UNAUTHENTICATED, name
        assert code_of(read, address, Credentials(tokens=tokens, role="worker")) == grpc.StatusCode.OK, name
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(120) == 130
