"""slipstream: RL post-training as services (buffer, rollout gateway, reward, trainer) that speak gRPC.

This package is the bottom layer, which imports no service: the generated protobuf/gRPC stubs (`slipstream.v1`), the
samples' helpers and the stubs' generator. The services, and the `slipstream` command (services/train/cli.py), live
in the `services` package.
"""

__version__ = "0.1.0"
