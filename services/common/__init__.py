"""Plumbing every service shares: config, the gRPC server lifecycle, errors, clients, Redis, plugins, logs, metrics."""
