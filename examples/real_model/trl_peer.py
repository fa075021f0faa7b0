"""The peer: TRL's GRPOTrainer on the same model, prompts, reward function (the reward service's `reasoning_gym`
verifier, called in-process), group size, prompts a step, learning rate and schedule, temperature, response length,
KL and clipping as the slipstream run; TRL's defaults otherwise (its DAPO loss, group-scaled rewards). Held-out
accuracy is measured the same way: greedy, with the same checker, at the start and every `eval_every` steps.
"""

import json
import time
from pathlib import Path

import torch

from services.reward.verifiers import reasoning_gym as score


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reward(prompts, completions, label, metadata, **_) -> list[float]:
    return [
        score(c[-1]["content"], gold, json.loads(m))["score"]
        for c, gold, m in zip(completions, label, metadata, strict=True)
    ]


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Greedy held-out accuracy, the prompts batched with left padding."""
    model.eval()
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    tokenizer.padding_side = side
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    responses = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(score(t, r["label"], r["metadata"])["acc"] for t, r in zip(responses, rows, strict=True)) / len(rows)


def run_trl(args, settings, model_dir: Path, train: Path, held_out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [{**r, "metadata": json.dumps(r["metadata"])} for r in _rows(train)]  # one column type for every task
    evaluation = _rows(held_out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gpu = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(args.out / args.name),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.samples_per_prompt,
        num_generations=settings.samples_per_prompt,
        max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        adam_beta2=settings.adam_beta2,
        max_grad_norm=settings.clip_grad,
        beta=settings.kl_coef,
        epsilon=settings.eps_clip,
        bf16=gpu,
        use_cpu=not gpu,
        seed=settings.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    log = {"evals": [], "step_s": [], "tokens": []}

    class Measure(TrainerCallback):
        started = 0.0

        def evaluate(self, step: int) -> None:
            found, train_s = accuracy(model, tokenizer, evaluation, settings.max_new_tokens), sum(log["step_s"])
            log["evals"].append({"step": step, "accuracy": found, "num_samples": len(evaluation), "train_s": train_s})
            print(f"{args.name} step {step}: held-out accuracy {found:.3f} after {train_s:.0f} s", flush=True)

        def on_train_begin(self, *_, **__):
            self.evaluate(0)

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, _, state, *__, **___):
            log["step_s"].append(time.perf_counter() - self.started)
            if state.global_step % settings.eval_every == 0 or state.global_step == settings.steps:
                self.evaluate(state.global_step)

        def on_log(self, _, state, __, logs=None, **___):
            if logs and "completions/mean_length" in logs:
                log["tokens"].append(logs["completions/mean_length"] * config.per_device_train_batch_size)
                log.setdefault("train_reward", []).append(logs.get("reward", 0.0))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Measure()],
    )
    try:
        trainer.train()
    except Exception as e:  # TRL's own failure (at lr 1e-5 its sampling met non-finite probabilities): what it measured
        log["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"  # until then is still the run's result
        print(f"{args.name}: TRL stopped after {len(log['step_s'])} steps: {log['error']}", flush=True)
    seconds = sorted(log["step_s"])
    return {
        **({"error": log["error"]} if "error" in log else {}),
        "evals": log["evals"],
        "s_per_step": seconds[len(seconds) // 2],
        "tokens_per_s": sum(log["tokens"]) / sum(log["step_s"]),
        "train_reward": log.get("train_reward", []),
    }
