"""Builds tiny HF checkpoints for tests and the demo: a real tokenizer (byte-level BPE trained on a small built-in
corpus, with a Qwen-style chat template), written in the same on-disk format as downloaded checkpoints.

Models cannot be downloaded here, so every test that needs a tokenizer or model builds one with this module.
"""

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

# Newlines are written as {{ "\n" }}: HF renders templates with trim_blocks, which drops a newline after a block tag.
CHAT_TEMPLATE = (
    '{% if tools %}<|im_start|>system{{ "\n" }}You can call these tools:'
    '{% for tool in tools %}{{ "\n" }}{{ tool | tojson }}{% endfor %}<|im_end|>{{ "\n" }}{% endif %}'
    '{% for message in messages %}<|im_start|>{{ message.role }}{{ "\n" }}{{ message.content }}<|im_end|>{{ "\n" }}'
    "{% endfor %}"
    '{% if add_generation_prompt %}<|im_start|>assistant{{ "\n" }}'
    '{% if enable_thinking is defined and not enable_thinking %}<think>{{ "\n\n" }}</think>{{ "\n\n" }}{% endif %}'
    "{% endif %}"
)

_CORPUS = [
    "What is 1 + 2? The answer is 3.",
    "Compute 12 * 7 and put the final answer in \\boxed{84}.",
    "Solve for x: 2x + 3 = 11, so x = 4. Answer: 4",
    "The quick brown fox jumps over the lazy dog.",
    "Let me think step by step. First add the numbers, then check the result.",
    "#### 42",
    "user assistant system tool call function arguments name result",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) { } [ ]",
]


def write_tokenizer(path: Path, vocab_size: int = 512, corpus: list[str] | None = None) -> Path:
    """Trains a byte-level BPE tokenizer (deterministic) and saves it with its chat template under `path`. With a
    `corpus`, only its characters make the alphabet (a task's own small vocabulary); else every byte does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=[] if corpus else pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or _CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def write_classifier(path: Path, num_labels: int = 1) -> Path:
    """A tiny randomly initialised Llama sequence-classification model with the tokenizer above (a reward model)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    path = write_tokenizer(path)
    config = LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    return path


# Qwen3-0.6B's layers (28 of hidden 1024, 16 query and 8 key-value heads of 128, MLP 3072, tied embeddings), with the
# test tokenizer's vocabulary: 0.44 B parameters, the real model's without its 151936-token embedding.
QWEN3_0_6B = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)  # fmt: skip


# Each family's distinguishing features, in miniature (hidden 64): GLM-4-9B-0414 (qkv bias, half of each head
# rotated, interleaved; sandwich norms; fused gate_up_proj), GLM-4.5 (a dense first layer, then 8 routed experts top-2
# + a shared one behind a sigmoid router with e_score_correction_bias, routed_scaling_factor 2.5), DeepSeek-V3
# (multi-latent attention with yarn rope, and its router: 8 experts in 2 groups, a token's 2 from 1 group).
FAMILY_SETTINGS = {
    "glm4": dict(attention_bias=True, partial_rotary_factor=0.5, rms_norm_eps=1e-5),
    "glm4_moe": dict(
        num_hidden_layers=3, attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=False,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_nextn_predict_layers=0, rms_norm_eps=1e-5,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=24, rope_interleave=True, num_mtp_layers=0, max_position_embeddings=1280,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0},
    ),
}  # fmt: skip


def _spread(model) -> None:
    """Weights that HF initialises trivially, made random, so that a norm, bias or routing mix-up shows: norms around
    1, biases around 0, routers' scores apart (no near-ties between experts), a random expert-score correction."""
    import torch

    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
        elif name.endswith(".bias"):
            tensor.copy_(0.1 * torch.randn_like(tensor))
        elif name.endswith("mlp.gate.weight"):
            tensor.normal_(0, 0.3)
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.3 * torch.randn_like(tensor))


def write_tiny_model(
    path: Path,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    seed: int = 0,
    arch: str = "qwen3",
    corpus: list[str] | None = None,
    vocab_size: int = 512,
    lm_head_scale: float = 20.0,
    dtype: str = "float32",
    **shape,
) -> Path:
    """A randomly initialised causal LM (safetensors, config, tokenizer, chat template) under `path`: Qwen3 (or
    `arch` qwen2 / llama / qwen3_moe / glm4 / glm4_moe / deepseek_v3), tiny by default; `shape` overrides config
    fields (QWEN3_0_6B: that model's layers). transformers writes the on-disk layout of the released checkpoints
    (one tensor per expert). `corpus` and `vocab_size` shape the tokenizer; `lm_head_scale` sharpens the initial
    next-token distribution."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    path = write_tokenizer(path, vocab_size, corpus)
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, tie_word_embeddings=False, rope_theta=10000.0, torch_dtype=dtype,
    )  # fmt: skip
    if arch == "qwen3_moe":  # Qwen3-30B-A3B's router (renormalised top-k) with 8 small experts, 2 per token
        settings |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    settings |= FAMILY_SETTINGS.get(arch, {})
    config = config_class(**{**settings, **shape})
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    with torch.no_grad():  # larger logits than the default init, so sampling is not uniform noise
        model.lm_head.weight.mul_(lm_head_scale)
        if arch in FAMILY_SETTINGS:
            _spread(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    return path
