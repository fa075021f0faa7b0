"""Reference-engine fixtures: the rollout tests' tiny checkpoint and real `slipstream engine` processes, shared with
them (the gateway's tests start the same engines)."""

from tests.rollout.conftest import engine_url, hf_model, start_engine, tiny_model

__all__ = ["engine_url", "hf_model", "start_engine", "tiny_model"]
