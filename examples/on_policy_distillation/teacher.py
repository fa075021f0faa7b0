"""The teacher of the on-policy distillation example: the demo's tiny model (services/train/demo.py), first trained
on the demo's task by supervised fine-tuning on its training prompts (the larger digit as the answer), then saved as
an HF folder that a teacher engine serves."""

import itertools
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.train.demo import HELD_OUT


def train_teacher(model_dir: Path, out_dir: Path, steps: int = 300, lr: float = 1e-2, seed: int = 0) -> Path:
    """Fine-tunes `model_dir` on every training pair's answer token (cross-entropy, full batch) and writes the
    teacher to `out_dir` (weights, config, tokenizer); returns `out_dir`. Seconds on a CPU, printing its progress."""
    torch.manual_seed(seed)
    # One thread: the tiny model's ops are too small to split, and two threads on a busy 2-core machine wait on each
    # other (300 steps took 127 s there against 11 s on one, with the same losses).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fine_tune(model_dir, out_dir, steps, lr)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _fine_tune(model_dir: Path, out_dir: Path, steps: int, lr: float) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = [p for p in itertools.permutations(range(10), 2) if p not in HELD_OUT]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"{a} {b}"}], add_generation_prompt=True)
        for a, b in pairs
    ]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    answers = torch.tensor([tokenizer.encode(str(max(a, b)), add_special_tokens=False)[0] for a, b in pairs])
    width = max(len(p) for p in prompts)
    assert all(len(p) == width for p in prompts), "the demo's prompts are all one length"
    inputs = torch.tensor(prompts)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    print(f"teacher: {steps} steps of fine-tuning on the {len(pairs)} training pairs, to {out_dir}", flush=True)
    for step in range(1, steps + 1):
        logits = model(input_ids=inputs).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, answers)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps:
            right = (logits.argmax(-1) == answers).float().mean()
            print(f"teacher: step {step}/{steps}  loss {loss.item():.4f}  right {right:.2f}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for path in Path(model_dir).iterdir():  # the tokenizer and chat template
        if path.is_file() and not path.name.endswith(".safetensors") and not (out_dir / path.name).exists():
            shutil.copy2(path, out_dir / path.name)


def accuracy(model_dir: Path) -> float:
    """The share of training pairs whose greedy answer is the larger digit."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = [p for p in itertools.permutations(range(10), 2) if p not in HELD_OUT]
    right = 0
    for a, b in pairs:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{a} {b}"}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        right += tokenizer.decode([token]).strip() == str(max(a, b))
    return right / len(pairs)
