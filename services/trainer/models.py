"""The trainer's model layer: an HF checkpoint directory (of a family in `families/`) becomes a megatron-core
GPTModel holding this rank's tensor- and expert-parallel shards, on CPU (gloo) or GPU.

`gpt_config_from_hf` turns config.json into megatron's TransformerConfig and checks it against the requested
parallelism; `load_gpt_model` builds the model and loads the weights through `hf_names`; `token_logprobs` reads
log-probabilities out of vocab-parallel logits, ignoring the vocab padding Megatron adds.
"""

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from services.trainer.cpu_shims import apply_cpu_shims, apply_missing_te_shims, cuda_available
from services.trainer.families import FAMILIES, Family
from services.trainer.grouped_experts import GroupedExperts
from services.trainer.hf_names import (
    ModelShape,
    gather_tp_param,
    hf_to_megatron,
    is_expert,
    megatron_to_hf,
    megatron_to_hf_views,
    tp_split_dim,
)
from services.trainer.lora import merged
from services.trainer.param_names import checkpoint_tensors, global_layer_names

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

try:  # Transformer Engine cannot be installed on the machines measured so far; use it where it is.
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False
try:  # megatron's GroupedMLP needs it; where it is missing, the experts are GroupedExperts, torch's grouped GEMMs
    import grouped_gemm  # noqa: F401

    HAVE_GROUPED_GEMM = True
except ImportError:
    HAVE_GROUPED_GEMM = False


@dataclass(frozen=True)
class GPTConfig:
    """Everything needed to build the GPTModel for one checkpoint at one parallelism."""

    shape: ModelShape
    transformer: TransformerConfig
    model_type: str
    max_sequence_length: int
    rotary_base: float
    seq_len_interpolation_factor: float | None
    rope_scaling: bool
    rope_scaling_factor: float
    rotary_percent: float = 1.0
    family: Family = FAMILIES["llama"]


class SDPACoreAttention(MegatronModule):
    """Causal self-attention core through `torch.nn.functional.scaled_dot_product_attention` (flash / memory-
    efficient kernels), a drop-in for megatron's DotProductAttention.

    Megatron's local core attention materialises the [b, heads, s, s] scores and needs an explicit mask; on an H200
    it trained at 11.1k tok/s against 24.4k with this module. The attention mask argument is ignored: attention is
    always causal, which is also right for right-padded batches (padding only attends to earlier tokens).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        k_channels: int | None = None,  # multi-latent attention's q/k and v head sizes: SDPA takes them as they come
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size": config.context_parallel_size != 1,
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
            "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        if any(unsupported.values()):
            names = ", ".join(name for name, bad in unsupported.items() if bad)
            raise ValueError(f"SDPACoreAttention supports plain causal attention only; unsupported: {names}")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as in megatron and HF

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        """query [s, b, heads, d], key/value [s, b, groups, d] → context [s, b, heads * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes no attention_bias or packed_seq_params (packed sequences)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        # enable_gqa rather than repeating KV heads: 0.66 vs 0.71 ms forward+backward on an H200 (bf16, seq 4096,
        # 16 query / 8 KV heads of 128), and no copy of K and V.
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale, enable_gqa=True
            )
        batch, heads, seq, dim = context.shape
        return context.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


def read_hf_config(hf_dir: str | Path) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())


def _rope_settings(hf: dict) -> dict:
    """rope_theta and rope scaling from config.json, written by transformers 4 (`rope_theta`, `rope_scaling`) or
    5 (`rope_parameters`)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    settings = {
        "rotary_base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "seq_len_interpolation_factor": None,
        "rope_scaling": False,
        "rope_scaling_factor": 8.0,
    }
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return settings
    if rope_type == "linear":
        return {**settings, "seq_len_interpolation_factor": float(params["factor"])}
    if rope_type == "llama3":
        # megatron-core hard-codes Llama 3.1's low/high frequency factors and original context.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        actual = {key: params.get(key) for key in expected}
        if actual != expected:
            raise ValueError(f"llama3 rope scaling with {actual} is not supported; megatron-core assumes {expected}")
        return {**settings, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _check_supported(hf: dict, model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; only silu (SwiGLU) is")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported; set it to false in config.json")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")


def _check_parallel(shape: ModelShape, tp_size: int, pp_size: int, ep_size: int = 1, etp_size: int = 1) -> None:
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    problems = []
    if ep_size > 1 and not shape.num_experts:
        problems.append(f"expert-parallel size {ep_size} needs an MoE model; this one has no experts")
    if shape.num_experts and shape.num_experts % ep_size:
        problems.append(f"num_experts {shape.num_experts} is not divisible by expert-parallel size {ep_size}")
    if shape.num_experts and shape.moe_ffn_hidden_size % etp_size:
        problems.append(
            f"moe_intermediate_size {shape.moe_ffn_hidden_size} is not divisible by expert-tensor-parallel "
            f"size {etp_size}"
        )
    if heads % tp_size:
        problems.append(f"num_attention_heads {heads} is not divisible by tensor-parallel size {tp_size}")
    if heads % groups:
        problems.append(f"num_attention_heads {heads} is not divisible by num_key_value_heads {groups}")
    if groups % tp_size and tp_size % groups:
        problems.append(f"num_key_value_heads {groups} and tensor-parallel size {tp_size}: neither divides the other")
    if shape.ffn_hidden_size % tp_size:
        problems.append(f"intermediate_size {shape.ffn_hidden_size} is not divisible by tensor-parallel size {tp_size}")
    if shape.num_layers % pp_size:
        problems.append(f"num_hidden_layers {shape.num_layers} is not divisible by pipeline-parallel size {pp_size}")
    if problems:
        raise ValueError("; ".join(problems))


def padded_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padding: the vocab rounded up to a multiple of make_vocab_size_divisible_by * TP size."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def gpt_config_from_hf(
    hf: dict,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> GPTConfig:
    """Megatron's configuration for an HF config.json (as a dict), checked against the parallelism.

    Raises ValueError naming the numbers when the checkpoint cannot be split as requested or uses a feature the
    Megatron model cannot express.
    """
    model_type = hf.get("model_type", "")
    _check_supported(hf, model_type)
    family = FAMILIES[model_type]
    settings = family.settings(hf)
    etp_size = tp_size if etp_size is None else etp_size  # megatron's default: experts split as the dense layers
    heads = hf["num_attention_heads"]
    shape = ModelShape(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        padded_vocab_size=padded_vocab_size(hf["vocab_size"], tp_size, make_vocab_size_divisible_by),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=settings.get("add_qkv_bias", False),
        qk_layernorm=settings.get("qk_layernorm", False),
        num_experts=settings.get("num_moe_experts") or 0,
        moe_ffn_hidden_size=settings.get("moe_ffn_hidden_size") or 0,
        rules=family.rules,
    )
    _check_parallel(shape, tp_size, pp_size, ep_size, etp_size)
    if shape.num_experts:  # tokens travel to their experts' ranks by all-to-all (any number of tokens per rank)
        settings |= {
            "expert_model_parallel_size": ep_size,
            "expert_tensor_parallel_size": etp_size,
            "moe_token_dispatcher_type": "alltoall",
        }
    transformer = family.config_class(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda_available(),
        batch_p2p_comm=cuda_available(),  # batched p2p ends in torch.cuda.synchronize(); gloo sends one by one
        perform_initialization=False,  # every weight is overwritten by the checkpoint
        **settings,
    )
    rope = _rope_settings(hf) if family.gpt_rope else _rope_settings({})  # MLA's rope is in its config
    return GPTConfig(
        shape=shape,
        transformer=transformer,
        model_type=model_type,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        **rope,
        rotary_percent=family.rotary_percent(hf),
        family=family,
    )


def layer_spec(config: GPTConfig) -> TransformerBlockSubmodules:
    """megatron's decoder block spec for this pipeline stage (dense and MoE layers as `moe_layer_freq` says, MLA
    where the family has it): Transformer Engine's modules where it is installed; otherwise megatron's local ones
    with the SDPA core attention and torch's RMSNorm. Both name parameters as megatron does (see hf_names for the
    layer-norm difference)."""
    block = get_gpt_decoder_block_spec(config.transformer, use_transformer_engine=HAVE_TE, normalization="RMSNorm")
    for spec in {id(s): s for s in block.layer_specs}.values():  # the dense and the MoE layer's spec, each once
        config.family.adapt_spec(spec, config.transformer)
        experts = getattr(spec.submodules.mlp.submodules, "experts", None)
        if experts is not None and experts.module is SequentialMLP and not (HAVE_TE or HAVE_GROUPED_GEMM):
            experts.module = GroupedExperts  # two grouped GEMMs for all local experts (grouped_experts.py)
        if HAVE_TE:
            continue
        layer, attention = spec.submodules, spec.submodules.self_attention.submodules
        attention.core_attention = SDPACoreAttention
        layer.input_layernorm = layer.pre_mlp_layernorm = TorchRMSNorm
        for norm in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if config.transformer.qk_layernorm and hasattr(attention, norm):
                setattr(attention, norm, TorchRMSNorm)
    if not HAVE_TE:
        block.layer_norm = TorchRMSNorm
    return block


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm behind megatron's norm-builder signature (what the local spec builds, minus its refusal of
    sequence parallelism): under sequence parallelism its weight is marked, and the trainer sums its gradient over
    the tensor-parallel ranks, each of which saw a part of the sequence."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def build_gpt_model(config: GPTConfig, parallel_output: bool = True) -> GPTModel:
    """An uninitialised GPTModel for this rank's pipeline stage (megatron's groups must be initialised)."""
    apply_cpu_shims()
    apply_missing_te_shims()
    model = GPTModel(
        config=config.transformer,
        transformer_layer_spec=layer_spec(config),
        vocab_size=config.shape.padded_vocab_size,
        max_sequence_length=config.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=config.shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
        rope_scaling=config.rope_scaling,
        rope_scaling_factor=config.rope_scaling_factor,
        seq_len_interpolation_factor=config.seq_len_interpolation_factor,
        rotary_percent=config.rotary_percent,
    )
    config.family.adapt_model(model, config.transformer)
    if model.post_process and not config.transformer.sequence_parallel:  # sequence parallelism gathers along s
        model.output_layer.register_forward_pre_hook(_batch_first_input)
        model.output_layer.register_forward_hook(_sequence_first_view)
    # Megatron marks its tensor-parallel shards only when it initialises them, and these are loaded instead; the
    # marks tell gradient-norm code which parameters count on every rank.
    for name, param in model.named_parameters():
        dim = tp_split_dim(name)
        transformer = config.transformer
        split = transformer.expert_tensor_parallel_size if is_expert(name) else transformer.tensor_model_parallel_size
        if dim is not None and split > 1:
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    return model


# The output layer computes the logits batch-first, `[b, s, V]` in memory, and hands them back as the `[s, b, V]` view
# GPTModel expects: GPTModel's `logits.transpose(0, 1).contiguous()` then copies nothing, and neither does the output
# layer's backward with their gradient. Each of those copies is the whole logits of a micro-batch (2.5 GB at two
# sequences of 4,096 tokens and Qwen3's 151,936 columns); the hidden states' copy here is 1 / 74 of that.
def _batch_first_input(layer, args):
    return (args[0].transpose(0, 1).contiguous(), *args[1:])


def _sequence_first_view(layer, args, output):
    logits, bias = output
    return logits.transpose(0, 1), bias


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """An HF checkpoint's tensors by name, read from its safetensors file(s) only when asked for."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self._handles = [safe_open(hf_dir / name, framework="pt") for name in files]
        self._where = {key: handle for handle in self._handles for key in handle.keys()}  # noqa: SIM118

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def served_tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """`checkpoint_tensors` as the engines serve them: a LoRA-adapted layer's weight with its adapter folded in."""
    tensors = checkpoint_tensors(model)
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            tensors[f"{name}.weight"] = merged(name, module)
    return tensors


def load_hf_weights(
    model: GPTModel, config: GPTConfig, weights: Mapping[str, torch.Tensor], keep_float32: bool = False
) -> None:
    """Copies this rank's shards of the HF `weights` into `model`; raises ValueError on a missing tensor or a shape
    that does not match. `keep_float32`: a float32 checkpoint's values of lower-precision parameters are kept for the
    optimizer's masters (`checkpoint_value`, which `optimizer.MasterAdamW` takes)."""
    params = checkpoint_tensors(model)
    by_global = {global_name: name for name, global_name in global_layer_names(model).items()}
    fused_norms = any(name.endswith("linear_qkv.layer_norm_weight") for name in params)
    shards = hf_to_megatron(
        weights,
        config.shape,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        fused_norms=fused_norms,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    loaded = set()
    with torch.no_grad():
        for global_name, shard in shards:
            name = by_global.get(global_name)
            if name is None:  # another pipeline stage's weight, or the tied output layer
                continue
            if params[name].shape != shard.shape:
                raise ValueError(
                    f"{global_name}: checkpoint gives {tuple(shard.shape)}, model has {params[name].shape}"
                )
            if name.endswith("router.expert_bias"):  # float32 whatever the model's dtype, as megatron and HF keep it
                params[name].data = params[name].data.float()
            params[name].copy_(shard)
            if keep_float32 and shard.dtype == torch.float32 and params[name].dtype != torch.float32:
                # The optimizer's float32 master starts from the checkpoint's value, not from its bf16 rounding:
                # a master on the bf16 grid moves the bf16 weight only once its updates add up to half a step of
                # that grid, which at RL learning rates takes hundreds of steps (optimizer.MasterAdamW).
                params[name].checkpoint_value = shard.to(params[name].device)
            loaded.add(name)
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"the checkpoint gives no value for {len(missing)} parameters, e.g. {missing[:3]}")


def load_gpt_model(
    hf_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    keep_float32: bool = False,
    **transformer_settings,
) -> tuple[GPTModel, GPTConfig]:
    """Builds the GPTModel for an HF checkpoint directory at the tensor/pipeline parallelism megatron was
    initialised with (`parallel.init_parallel`) and loads this rank's shards of the weights. `transformer_settings`
    override TransformerConfig fields (sequence_parallel, recompute_granularity, …)."""
    config = gpt_config_from_hf(
        read_hf_config(hf_dir),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dtype=dtype,
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    if transformer_settings:
        config = dataclasses.replace(
            config, transformer=dataclasses.replace(config.transformer, **transformer_settings)
        )
    model = build_gpt_model(config, parallel_output=parallel_output)
    # The torch norms of the local spec are built on CPU in float32 whatever params_dtype says.
    model.to(device=torch.cuda.current_device() if cuda_available() else "cpu", dtype=dtype)
    load_hf_weights(model, config, SafetensorsWeights(hf_dir), keep_float32)
    return model, config


def hf_weights_of(model: GPTModel, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights as full HF (name, tensor) pairs, gathered over the tensor-parallel group, and
    the experts over the expert-tensor- and expert-parallel groups, one parameter at a time (a collective: every
    rank of those groups iterates it to the end)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    global_names = global_layer_names(model)
    for name, param in served_tensors(model).items():
        if not is_expert(name):
            full = gather_tp_param(global_names[name], param.detach(), group=tp_group)
            yield from megatron_to_hf(global_names[name], full, config.shape)
            continue
        full = gather_tp_param(name, param.detach(), group=parallel_state.get_expert_tensor_parallel_group())
        yield from _gather_experts(global_names[name], full, config)


class WeightViews:
    """`hf_weights_of`'s tensors as views of the parameters, made once and kept while no parameter's storage moved
    (a `.data` set anew): (HF name, view, HF shape), each view's elements in its HF tensor's order. Where a sync
    converts nothing (no tensor or expert parallelism, no adapters folded in), the weight sync copies these straight
    into its buckets; elsewhere None. The model keeps its parameter objects (megatron's do): a model built anew
    needs WeightViews anew."""

    def __init__(self, model: GPTModel, config: GPTConfig):
        self.model, self.config = model, config
        sizes = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        self.viewable = sizes == (1, 1, 1) and not any(hasattr(m, "lora_A") for m in model.modules())
        self.views: list[tuple[str, torch.Tensor, torch.Size]] | None = None
        self.held: list[tuple[torch.Tensor, int]] = []  # every parameter and buffer, with its storage then

    def __call__(self) -> list[tuple[str, torch.Tensor, torch.Size]] | None:
        if not self.viewable:
            return None
        if self.views is None or any(t.data_ptr() != ptr for t, ptr in self.held):
            global_names = global_layer_names(self.model)
            self.views = [
                view
                for name, tensor in served_tensors(self.model).items()
                for view in megatron_to_hf_views(global_names[name], tensor.detach(), self.config.shape)
            ]
            self.held = [(t, t.data_ptr()) for t in (*self.model.parameters(), *self.model.buffers())]
        return self.views


def _gather_experts(name: str, tensor: torch.Tensor, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The same local expert of every expert-parallel rank (each holds other experts), as HF pairs in expert order."""
    group = parallel_state.get_expert_model_parallel_group()
    ep_size = torch.distributed.get_world_size(group) if group is not None else 1
    if ep_size == 1:
        yield from megatron_to_hf(name, tensor, config.shape)
        return
    held = [torch.empty_like(tensor) for _ in range(ep_size)]
    torch.distributed.all_gather(held, tensor.contiguous(), group=group)
    prefix, rest = name.split("mlp.experts.local_experts.")
    expert, weight = rest.split(".", 1)
    local = config.shape.num_experts // ep_size
    for rank, part in enumerate(held):  # `name` holds this rank's global number; each rank's is offset by `local`
        number = int(expert) % local + rank * local
        yield from megatron_to_hf(f"{prefix}mlp.experts.local_experts.{number}.{weight}", part, config.shape)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(token) from this rank's vocab slice of the logits ([..., padded_vocab / TP]), in float32.

    The padding columns Megatron adds are excluded from the softmax, so the result equals HF's log-softmax over the
    real vocab. A collective over the tensor-parallel group; differentiable.
    """
    shard_size = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard_size
    is_padding = torch.arange(start, start + shard_size, device=logits.device) >= vocab_size
    masked = logits.float().masked_fill(is_padding, float("-inf"))
    return -tensor_parallel.vocab_parallel_cross_entropy(masked, tokens)
