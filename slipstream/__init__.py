"""slipstream: RL post-training as services (buffer, rollout gateway, reward, trainer) that speak gRPC.

This package holds the command-line entry and the generated protobuf/gRPC stubs (`slipstream.v1`); the services
themselves live in the `services` package.
"""

__version__ = "0.1.0"
