"""Configuration of the reference engine (`slipstream engine`)."""

from typing import Literal

from pydantic import Field

from services.common.config import StrictModel


class EngineConfig(StrictModel):
    """The reference engine: SGLang's HTTP API on an HF transformers model, on CPU or GPU."""

    other_names = {"--hf-checkpoint": "--model-path", "--model": "--model-path"}  # slime's and vLLM's name for it

    model_path: str
    """HF checkpoint folder (config, safetensors, tokenizer) of a Llama, Qwen2 or Qwen3 model."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(30000, ge=0, le=65535)
    """HTTP port (SGLang's default)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the model runs."""
    base_gpu_id: int = Field(0, ge=0)
    """The GPU it runs on with --device cuda, in the node's numbering (SGLang's option). Colocated with the trainer,
    it also says whose tensor handles this engine reads: those of the trainer rank on that GPU (on CPU, of that
    local rank)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype; auto is float32 on CPU and bfloat16 on CUDA."""
    max_running_requests: int = Field(64, ge=1)
    """Most sequences decoded together (SGLang's name); more wait for a free row."""
    page_size: int = Field(16, ge=1, le=256)
    """Positions a block of the KV cache holds (SGLang's option): the unit of the cache's allocation and of prefix
    sharing; a power of two."""
    chunked_prefill_size: int = Field(8192, ge=16)
    """Most tokens one forward runs (SGLang's option): longer prompts are prefilled over several steps, beside the
    sequences that decode."""
    mem_fraction_static: float = Field(0.85, gt=0, lt=1)
    """The KV cache grows as sequences need it while the device keeps 1 - this fraction of its memory free (SGLang's
    option, as a bound on growth: a colocated trainer's memory stays its own)."""
    max_total_tokens: int | None = Field(None, ge=16)
    """Most positions the KV cache holds (SGLang's option); unset, --mem-fraction-static bounds it."""
    disable_cuda_graph: bool = False
    """Run each decode step eagerly (SGLang's option). By default a CUDA engine replays its decode step from CUDA
    graphs, one per batch row count (rounded up to a power of two, up to --max-running-requests)."""
    enable_torch_compile: bool = False
    """Compile the model's layers with torch.compile (SGLang's option): their elementwise work fused into a few
    kernels a layer, which a small model's decode step is bound by. The first steps wait for the compilation (about
    a minute on a GPU); models served with LoRA adapters or routed-expert capture run as written."""
    weight_update_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one bucket's receive in a weight update: a broadcast that has not arrived by then (its sender
    stalled or died) is aborted and the update fails, so the engine never waits on a dead weight group."""
    weight_disk_dir: str | None = None
    """The folder /update_weights_from_disk may load checkpoints from (any folder under it); unset, the route loads
    none. The gateway's --update-weight-disk-dir, for engines it launches."""
    enable_lora: bool = False
    """Serve LoRA adapters (SGLang's option): /load_lora_adapter loads a peft folder from under --weight-disk-dir,
    and /generate's lora_path names the adapter of each prompt."""
    max_lora_rank: int = Field(64, ge=1)
    """The highest adapter rank /load_lora_adapter takes (SGLang's option)."""
    lora_target_modules: list[str] = ["all-linear"]
    """The linear layers adapters may target, by name (q_proj, …, lm_head) or all (SGLang's option)."""
    enable_return_routed_experts: bool = False
    """Capture each MoE layer's chosen experts so that /generate can return them (SGLang's option, for rollout
    routing replay); Qwen3-MoE, GLM-4.5 and DeepSeek-V3 models only."""
    api_key: str | None = None
    """Every route but /health* and /metrics needs `Authorization: Bearer <api_key>` (SGLang's option)."""
    weight_version: str = "default"
    """Initial weight version (SGLang's --weight-version)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level that is printed."""
