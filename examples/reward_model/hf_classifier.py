"""A reward model plugin: scores (prompt, response) with an HF sequence-classification model.

    slipstream reward --custom-rm-path examples/reward_model/hf_classifier.py:score \
        --custom-rm-args '{"model_path": "/models/my-rm", "device": "cpu"}'

The model is loaded once per reward worker process, on its first item; its first logit is the reward. torch and
transformers are imported with the module, so a worker has them before the service says it is ready. Tests run it on a
tiny randomly initialised model: the real code path, on the CPU.
"""

from functools import cache

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


@cache
def _load(model_path: str, device: str):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, torch_dtype=torch.float32).to(device)
    return tokenizer, model.eval()


def score(args, sample) -> dict:
    settings = args.custom_rm_args
    tokenizer, model = _load(settings["model_path"], settings.get("device", "cpu"))
    max_length = int(settings.get("max_length", 4096))
    inputs = tokenizer(sample.prompt + sample.response, return_tensors="pt", truncation=True, max_length=max_length)
    with torch.no_grad():
        logits = model(**inputs.to(model.device)).logits[0]
    return {"score": float(logits[0]), "num_tokens": float(inputs["input_ids"].shape[1])}
