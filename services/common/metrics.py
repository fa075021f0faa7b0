"""Prometheus metrics: the /metrics endpoint every service serves, and the RPC counters every server records."""

import logging

import prometheus_client

log = logging.getLogger(__name__)

RPC_REQUESTS = prometheus_client.Counter(
    "slipstream_rpc_requests", "RPCs handled, by service, method and status code", ["service", "method", "code"]
)
RPC_LATENCY = prometheus_client.Histogram(
    "slipstream_rpc_latency_seconds", "Time to handle an RPC, by service and method", ["service", "method"]
)


def serve_metrics(host: str, port: int) -> tuple[int, object]:
    """Serves /metrics from a background thread; returns the bound port and the server (to shut down)."""
    server, _thread = prometheus_client.start_http_server(port, addr=host)
    return server.server_port, server
