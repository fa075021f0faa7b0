"""The gRPC server lifecycle every service shares.

Health starts NOT_SERVING and turns SERVING once the service is ready; reflection lists the services; SIGTERM or
SIGINT turns health NOT_SERVING, lets in-flight RPCs finish for the grace period, closes the service's clients and
exits 0. A service module only says which servicers to add and what to close (`Service`).
"""

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import AuthInterceptor, TokenFile
from services.common.clients import STREAM_WINDOW_BYTES
from services.common.config import ConfigError, ServiceConfig, command_config
from services.common.errors import STOPPED, RunStopped, StartupError
from services.common.interceptor import ServiceInterceptor
from services.common.logs import setup_logging
from services.common.metrics import serve_metrics
from services.common.processes import keep_port
from services.common.tls import server_credentials

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Servicer:
    """One gRPC service to add: the generated `add_*_to_server` function, the implementation and its full name."""

    add_to_server: Callable
    impl: object
    name: str  # e.g. "slipstream.v1.BufferService"

    @classmethod
    def of(cls, impl: object) -> "Servicer":
        """For an instance of a subclass of a generated `slipstream.v1` servicer base, e.g. `BufferServiceServicer`."""
        base = next(b for b in type(impl).__mro__ if b.__module__.startswith("slipstream.v1."))
        add_to_server = getattr(sys.modules[base.__module__], f"add_{base.__name__}_to_server")
        return cls(add_to_server, impl, "slipstream.v1." + base.__name__.removesuffix("Servicer"))


@dataclass
class Service:
    """What a service module hands to the lifecycle."""

    name: str  # "buffer", "rollout", ...
    config: ServiceConfig
    servicers: list[Servicer]
    ready: Callable[[], Awaitable[None]] | None = None  # runs after the port is bound, before health says SERVING
    on_stop: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)
    finished: asyncio.Future | None = None  # a service that ends by itself (the trainer) resolves it; an error fails it


def grpc_options(config: ServiceConfig) -> list[tuple[str, int]]:
    max_bytes = config.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # Clients ping idle connections (see services.common.clients); accept their pings without a call in flight.
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Batches are many MiB: a larger HTTP/2 stream window lets them flow without waiting on window updates.
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        # Without this a second server could bind the same port and silently share its traffic.
        ("grpc.so_reuseport", 0),
    ]


class GrpcServer:
    """Runs one `Service`: start, report health, stop gracefully."""

    def __init__(self, service: Service):
        self.service = service
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None
        self._stopping = False

    async def start(self) -> int:
        cfg = self.service.config
        interceptors = [ServiceInterceptor(self.service.name)]
        if cfg.auth.token_file is not None:  # first: a refused call reaches nothing else
            interceptors.insert(0, AuthInterceptor(self.service.name, TokenFile(cfg.auth.token_file)))
        server = grpc.aio.server(interceptors=interceptors, options=grpc_options(cfg))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [s.name for s in self.service.servicers]
        for servicer in self.service.servicers:
            servicer.add_to_server(servicer.impl, server)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        for name in ["", *names]:
            await self.health.set(name, NOT_SERVING)
        try:
            address = f"{cfg.host}:{cfg.port}"
            if cfg.tls.enabled:
                self.port = server.add_secure_port(address, server_credentials(cfg.tls))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise StartupError(
                f"cannot listen on {cfg.host}:{cfg.port}: the port is in use or the address is not on this machine; "
                "pass --port with a free port (0 picks one) or stop the process holding it"
            )
        self._server = server
        await server.start()
        if cfg.metrics_port is not None:
            self.metrics_port, self._metrics_server = serve_metrics(cfg.host, cfg.metrics_port)
        if self.service.ready is not None:
            await self.service.ready()
        for name in ["", *names]:
            await self.health.set(name, SERVING)
        security = ("mutual TLS" if cfg.tls.ca_file else "TLS") if cfg.tls.enabled else "plaintext"
        security += ", bearer tokens" if cfg.auth.token_file else ", no authentication"
        log.info(
            "%s serving on %s:%d, %s (metrics port %s)",
            self.service.name,
            cfg.host,
            self.port,
            security,
            self.metrics_port or "off",
        )
        return self.port

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("%s stopping: health NOT_SERVING, draining for up to %.1fs", self.service.name, self.config_grace)
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config_grace)
        for close in self.service.on_stop:
            try:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("%s: error while closing", self.service.name)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        log.info("%s stopped", self.service.name)

    @property
    def config_grace(self) -> float:
        return self.service.config.grace_period_s

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


Build = Callable[[Any], Awaitable[Service]]


def main_for(name: str, model: type[ServiceConfig], build: Build, argv: list[str] | None) -> int:
    """The whole body of `slipstream <name>`: parse the config, serve until SIGTERM/SIGINT, return the exit code."""
    config = command_config(model, argv, name)
    return 2 if config is None else run_service(build, config)


def run_service(build: Build, config: ServiceConfig) -> int:
    """Builds and serves the service until SIGTERM/SIGINT; a startup problem is logged as one sentence, exit 1."""
    setup_logging(config.log_level, config.log_format)
    try:
        return uvloop.run(_serve(build, config))
    except RunStopped as e:
        log.error("%s", e)
        return STOPPED
    except (StartupError, ConfigError) as e:
        log.error("%s", e)
        return 1


async def _serve(build: Build, config: ServiceConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    keep_port(config.port)  # the engines a gateway starts while it builds must not be handed it
    service = await build(config)
    server = GrpcServer(service)
    try:
        await server.start()
        # What the start made (modules, configuration, clients, a model) lives as long as the process: out of the
        # collector's reach, a full collection no longer walks it (tens of ms with 10^5 objects, an RPC's wait).
        gc.freeze()
        waits = [asyncio.ensure_future(stop.wait())]
        if service.finished is not None:
            waits.append(service.finished)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if service.finished is not None and service.finished.done() and service.finished.exception() is not None:
            if isinstance(error := service.finished.exception(), RunStopped):
                raise error
            raise StartupError(f"{service.name} failed: {error}")
    finally:
        await server.stop()
    return 0
