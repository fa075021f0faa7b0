"""Client side of the gRPC plumbing: channels with deadlines, keepalive and retries on UNAVAILABLE.

Retries use gRPC's own retry policy (service config), so a service that restarts behind an address is retried with
exponential backoff instead of failing the caller at once. Every call needs a deadline: pass `timeout=`. The service
config sets none: gRPC takes the shorter of the two, so a channel-wide default would cut every longer call short.
"""

import json
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import BearerToken, TokenFile, aio_bearer_tokens
from services.common.config import ServiceConfig, TlsConfig
from services.common.tls import channel_credentials

STREAM_WINDOW_BYTES = 32 * 1024 * 1024


def channel_options(max_message_mb: int = 256, max_attempts: int = 5) -> list:
    """`max_attempts` 1 turns gRPC's retries off (for callers that retry themselves)."""
    method = {"name": [{}]}  # every method of every service
    if max_attempts > 1:
        method["retryPolicy"] = {
            "maxAttempts": max_attempts,
            "initialBackoff": "0.1s",
            "maxBackoff": "5s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    # Round robin over every address the name resolves to: a name with several replicas behind it (compose's
    # `deploy.replicas`, a Kubernetes headless Service) spreads the calls over all of them.
    service_config = {"methodConfig": [method], "loadBalancingConfig": [{"round_robin": {}}]}
    max_bytes = max_message_mb * 1024 * 1024
    return [
        ("grpc.service_config", json.dumps(service_config)),
        ("grpc.enable_retries", 1),
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        # Batches are many MiB: a larger HTTP/2 stream window lets them flow without waiting on window updates.
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        # Notice a dead server within a minute even on an idle connection (a long GetBatch wait, say).
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A connection that failed is tried again within 5 s, not gRPC's default of up to 120 s: a restarted service
        # is found at once by calls that wait for it (wait_for_ready), and by new channels, which share the process's
        # connection to an address and its backoff.
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


@dataclass(frozen=True)
class Credentials:
    """How a process's calls to a service are secured: TLS as its own config says, and the bearer token of the role
    the calls need (services.common.auth)."""

    tls: TlsConfig = field(default_factory=TlsConfig)
    tokens: TokenFile | None = None
    role: str = "admin"

    @classmethod
    def of(cls, config: ServiceConfig, role: str) -> "Credentials":
        tokens = TokenFile(config.auth.token_file) if config.auth.token_file else None
        return cls(config.tls, tokens, role)


PLAINTEXT = Credentials()


def open_channel(address: str, credentials: Credentials = PLAINTEXT, **options) -> grpc.Channel:
    """A blocking channel to `host:port` with the retry and keepalive policy above."""
    options = channel_options(**options)
    if credentials.tls.enabled:
        channel = grpc.secure_channel(address, channel_credentials(credentials.tls), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if credentials.tokens is None:
        return channel
    return grpc.intercept_channel(channel, BearerToken(credentials.tokens, credentials.role))


def open_aio_channel(address: str, credentials: Credentials = PLAINTEXT, **options) -> grpc.aio.Channel:
    """The asyncio flavour of `open_channel`, for use inside services."""
    options = channel_options(**options)
    tokens = [] if credentials.tokens is None else aio_bearer_tokens(credentials.tokens, credentials.role)
    if credentials.tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(credentials.tls), options, interceptors=tokens)
    return grpc.aio.insecure_channel(address, options, interceptors=tokens)


def health_status(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> str:
    """The health status name (`SERVING`, `NOT_SERVING`, ...) of `service` behind `channel`."""
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_until_serving(
    address: str, timeout_s: float = 30.0, service: str = "", credentials: Credentials = PLAINTEXT
) -> None:
    """Blocks until the server at `address` reports SERVING; raises TimeoutError naming the address otherwise."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with open_channel(address, credentials, max_attempts=1) as channel:
        while time.monotonic() < deadline:
            try:
                last = health_status(channel, service, timeout_s=min(2.0, timeout_s))
                if last == "SERVING":
                    return
            except grpc.RpcError as e:
                last = e.code().name
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s (last status: {last})")


if __name__ == "__main__":
    # Health probe for containers: `python -m services.common.clients host:port` exits 0 once SERVING.
    import sys

    try:
        wait_until_serving(sys.argv[1], timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 3.0)
    except TimeoutError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
