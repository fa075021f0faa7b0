"""The trainer's step metrics and where they go: model FLOPs utilisation, the rollout and reward parts of the wait for
a batch, and each step's line of --steps-file, log line and TensorBoard scalars."""

import json
import logging
import time
from pathlib import Path

import torch

from services.trainer.config import TrainerConfig
from services.trainer.parallel import ParallelInfo

log = logging.getLogger(__name__)

PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16


def mfu(shape, tokens_per_s_per_gpu: float, lengths: list[int]) -> float:
    """Model FLOPs utilisation with the PaLM count: 6 N + 12 L H Q S per token (S the mean sequence length)."""
    name = torch.cuda.get_device_name()
    peak = next((p for key, p in PEAK_TFLOPS.items() if key in name), None)
    if peak is None:
        return float("nan")
    h, q = shape.hidden_size, shape.head_dim
    params = (1 if shape.tie_word_embeddings else 2) * shape.vocab_size * h + shape.num_layers * (
        h * q * (2 * shape.num_attention_heads + 2 * shape.num_query_groups) + 3 * h * shape.ffn_hidden_size
    )
    seq = sum(lengths) / max(1, len(lengths))
    flops = 6 * params + 12 * shape.num_layers * shape.num_attention_heads * q * seq
    return tokens_per_s_per_gpu * flops / (peak * 1e12)


def rollout_times(groups, since: float, until: float) -> dict[str, float]:
    """Of the time the trainer waited for the batch (unix times `since` to `until`), the seconds during which some of
    its groups were being generated, and those during which some were being scored and none generated (unions of
    their intervals on the gateway's clock, the same machine's in a local run): the rollout and reward parts."""

    def union(spans):
        total, end = 0.0, since
        for a, b in sorted(spans):
            b = min(b, until)
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    t = [g.timings for g in groups if "scored" in g.timings]
    generating = union((x["leased"], x["generated"]) for x in t)
    busy = union([(x["leased"], x["generated"]) for x in t] + [(x["generated"], x["scored"]) for x in t])
    return {"rollout_s": generating, "reward_s": busy - generating} if t else {}  # scoring while none generates


class StepLog:
    """Where a step's metrics go: a line of --steps-file from the first rank of each data-parallel replica (with
    DP > 1, each replica's file has its part of the batch), and on rank 0 a log line and TensorBoard's scalars."""

    def __init__(self, config: TrainerConfig, info: ParallelInfo):
        self.steps_file = None
        if config.steps_file and info.tp_rank == 0 and info.pp_rank == 0:
            path = Path(config.steps_file)
            self.steps_file = path.with_name(f"{path.stem}.dp{info.dp_rank}{path.suffix}") if info.dp_rank else path
        self.reports = info.rank == 0
        self.writer = None
        if config.tensorboard_dir and self.reports:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(config.tensorboard_dir)

    def record(self, step: int, policy_version: int, group_ids: list[str], metrics: dict, **more) -> None:
        """The step's line of --steps-file (`more`: what else the line carries, such as the first reward errors)."""
        if self.steps_file is None:
            return
        line = {
            "step": step,
            "policy_version": policy_version,
            "time": time.time(),
            "groups": group_ids,
            "metrics": metrics,
            **{key: value for key, value in more.items() if value},
        }
        with self.steps_file.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def show_samples(self, step: int, samples: list[dict]) -> None:
        """TensorBoard's text of the step's shown samples (--log-samples)."""
        if self.writer is not None and samples:
            rows = [f"| {s['reward']:.3f} | {_cell(s['prompt'])} | {_cell(s['response'])} |" for s in samples]
            self.writer.add_text("samples", "\n".join(["| reward | prompt | response |", "|---|---|---|", *rows]), step)

    def report(self, step: int, metrics: dict, scalars: bool = True) -> None:
        """Rank 0's log line, and TensorBoard's scalars unless `scalars` is off (a custom log function took them)."""
        if not self.reports:
            return
        log.info(
            "step %d: reward %.3f, loss %.4f, clipfrac %.3f, grad norm %.3f, %.0f tokens/s",
            step,
            metrics["reward"],
            metrics.get("loss", 0.0),
            metrics.get("pg_clipfrac", 0.0),
            metrics.get("grad_norm", 0.0),
            metrics.get("tokens_per_s", metrics.get("critic/tokens_per_s", 0.0)),
        )
        if self.writer is not None and scalars:
            for name, value in metrics.items():
                self.writer.add_scalar(f"train/{name}", value, step)
            self.writer.flush()


def shown_samples(groups, count: int) -> list[dict]:
    """The first sample of each of the first `count` groups: its prompt, response and reward (--log-samples)."""
    return [
        {"prompt": g.prompt_text, "response": g.samples[0].response_text, "reward": g.samples[0].reward}
        for g in groups[:count]
        if g.samples
    ]


def _cell(text: str) -> str:
    """Text in one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")
