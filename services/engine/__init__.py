"""The reference engine: a small real inference server with SGLang's HTTP API, on HF transformers models."""
