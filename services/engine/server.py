"""Loads the model and serves the engine's HTTP API with uvicorn; SIGTERM stops it cleanly."""

import hmac
import logging
import os
import socket
import sys

import torch

from services.common.errors import StartupError
from services.engine.config import EngineConfig
from services.weightsync.group import apply_nccl_settings

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005


def load(config: EngineConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine import attention
    from services.engine.batch import CacheConfig
    from services.engine.core import Engine
    from services.engine.routing import RoutingCapture

    if config.device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda was asked for but CUDA is not available; pass --device cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.dtype)
    dtype = dtype or (torch.bfloat16 if config.device == "cuda" else torch.float32)
    if config.page_size & (config.page_size - 1):
        raise StartupError(f"--page-size must be a power of two, got {config.page_size}")
    attention.register()
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype,
                                                     attn_implementation=attention.NAME)  # fmt: skip
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot load a model from --model-path {config.model_path}: {e}") from None
    device = torch.device("cuda", config.base_gpu_id) if config.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":  # this thread's work (the load, the weight routes' copies) on the engine's GPU too
        torch.cuda.set_device(device)
    routing = RoutingCapture(model) if config.enable_return_routed_experts else None
    model = model.to(device).eval()
    adapters = None
    if config.enable_lora:
        from services.engine.lora import Adapters

        adapters = Adapters(model, config.max_lora_rank, config.lora_target_modules)
    pick = None
    if config.enable_torch_compile and adapters is None and routing is None:
        from services.engine.compiled import compile_decoder, compile_pick
        from services.engine.sampling import pick

        compile_decoder(model)
        pick = compile_pick(pick)
    graphs = None
    if device.type == "cuda" and not config.disable_cuda_graph:
        from services.engine.graphs import DecodeGraphs, bucket

        graphs = DecodeGraphs(device, bucket(config.max_running_requests))
    cache = CacheConfig(config.page_size, config.chunked_prefill_size, config.max_total_tokens,
                        config.mem_fraction_static)  # fmt: skip
    return Engine(model, tokenizer, device, config.max_running_requests, config.weight_version, routing, adapters,
                  graphs, cache, pick)  # fmt: skip


def require_api_key(app, key: str):
    """SGLang's --api-key: a request without `Authorization: Bearer <key>` gets 401, except health and metrics."""
    from starlette.responses import JSONResponse

    expected = f"Bearer {key}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith(("/health", "/metrics")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


def serve(config: EngineConfig) -> int:
    apply_nccl_settings()  # as SGLang's server does, and the trainer: both ends of the weight group must agree
    import uvicorn

    from services.engine.api import EngineAPI

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    try:
        held = _hold_port(config.host, config.port)  # a port in use is said at once, not after the model loads
        engine = load(config)
    except StartupError as e:
        log.error("%s", e)
        return 1
    info = {
        "model_path": config.model_path,
        "host": config.host,
        "port": config.port,
        "device": config.device,
        "max_running_requests": config.max_running_requests,
        "base_gpu_id": config.base_gpu_id,
        "gpu_id_step": 1,
    }
    # The engine thread runs Python between the steps it queues and rarely blocks; at Python's default switch
    # interval (5 ms) the server's thread would wait up to that long for each turn with the GIL, so requests that
    # arrive while it decodes would be read slowly.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = EngineAPI(engine, info, config.weight_update_timeout_s, config.weight_disk_dir).app()
    if config.api_key:
        app = require_api_key(app, config.api_key)
    held.close()
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def _hold_port(host: str, port: int) -> socket.socket:
    """A listening socket on the engine's address, held while the model loads (and closed for the server's own)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise StartupError(
            f"cannot listen on {host}:{port} ({os.strerror(e.errno) if e.errno else e}): pass --port with a free port, "
            "or stop the process holding it"
        ) from None
