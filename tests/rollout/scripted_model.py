"""A test fixture: a real Qwen3 checkpoint whose weights make it follow a script. Its attention and MLP outputs are
zero, so the last hidden state is the current token's (normalised) embedding and the LM head alone picks the next
token: a bigram model, built so that greedy decoding walks a given chain of distinct tokens with log-probs well
away from 0 (the margin is modest), which makes token-for-token alignment checks meaningful."""

import itertools
from pathlib import Path

from services.train.tiny_checkpoint import write_tiny_model


def write_scripted_model(path: Path, chain: list[int], margin: float = 6.0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    assert len(set(chain)) == len(chain), "a bigram model can only follow a chain of distinct tokens"
    path = write_tiny_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        hidden = embed / embed.pow(2).mean(-1, keepdim=True).add(model.config.rms_norm_eps).sqrt()
        head = torch.randn(model.lm_head.weight.shape, generator=generator) * 0.01
        for current, following in itertools.pairwise(chain):
            head[following] += margin * hidden[current] / hidden[current].pow(2).sum()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path
