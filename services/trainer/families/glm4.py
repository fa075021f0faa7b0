"""GLM-4 dense (`glm4`: GLM-4-9B-0414, GLM-Z1-9B): Llama's layer with biases on q, k and v, rope on the first half of
each head with (even, odd) channel pairs rotated together (megatron's `rotary_interleaved`), the MLP's gate and up
projections fused on disk (`gate_up_proj`, [gate; up]: megatron's `linear_fc1` as it is), and a "sandwich" norm on
the output of the attention and of the MLP before each residual add, which megatron's layer lacks
(`SandwichNormLayer`)."""

from megatron.core.transformer.transformer_layer import TransformerLayer

from services.trainer.families.base import DENSE, Family, Rule, copied


def partial_rotary_factor(hf: dict) -> float:
    """transformers 5 writes it in rope_parameters, the released files at the top; both configs default to 0.5."""
    return float((hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))


def settings(hf: dict) -> dict:
    return {"add_qkv_bias": bool(hf.get("attention_bias", True)), "rotary_interleaved": True}


def _norm_before(bias_dropout_add, norm):
    """Megatron's bias-dropout-add with `norm` applied to the branch's output first: residual + norm(branch)."""

    def factory(training: bool, fused: bool):
        add = bias_dropout_add(training, fused)

        def apply(output_and_bias, residual, probability):
            output, bias = output_and_bias
            if bias is not None:
                raise ValueError("a sandwich norm after a linear bias is not supported (GLM-4 has none)")
            return add((norm(output), None), residual, probability)

        return apply

    return factory


class SandwichNormLayer(TransformerLayer):
    """Megatron's TransformerLayer with GLM-4's post-attention and post-MLP norms (named as in the HF checkpoint),
    each applied to its branch's output inside the layer's own bias-dropout-add; every other path is megatron's.
    `post_norm` is the norm module the spec builds (the layer norms' class)."""

    def __init__(self, config, submodules, *args, post_norm=None, **kwargs) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        norm = post_norm or submodules.input_layernorm
        eps = config.layernorm_epsilon
        self.post_self_attn_layernorm = norm(config=config, hidden_size=config.hidden_size, eps=eps)
        self.post_mlp_layernorm = norm(config=config, hidden_size=config.hidden_size, eps=eps)
        self.self_attn_bda = _norm_before(self.self_attn_bda, self.post_self_attn_layernorm)
        self.mlp_bda = _norm_before(self.mlp_bda, self.post_mlp_layernorm)


def sandwich_layers(spec, config) -> None:
    spec.module = SandwichNormLayer


RULES = {
    **DENSE,
    "post_self_attn_layernorm.weight": copied("post_self_attn_layernorm.weight"),
    "post_mlp_layernorm.weight": copied("post_mlp_layernorm.weight"),
    "mlp.linear_fc1.weight": Rule(("mlp.gate_up_proj.weight",), 0, "gate_up"),
}
FAMILY = Family(rules=RULES, settings=settings, rotary_percent=partial_rotary_factor, adapt_spec=sandwich_layers)
