"""slime's flags that `slipstream train` refuses, each with the reason docs/ARGUMENTS.md gives (held equal by
tests/train/test_help.py): a refused flag is named as one with what to do instead, never as an unknown flag with the
closest name's hint (`--offload` is not `--load`)."""

REFUSED = {
    **dict.fromkeys(
        ("--num-gpus-per-node",),
        "The gateway launches engines on its own machine's GPUs; engines elsewhere join through --engine-urls"
        " or RegisterEngine.",
    ),
    **dict.fromkeys(
        ("--offload", "--offload-train"), "The trainer is not offloaded; the engines' side is --offload-rollout."
    ),
    **dict.fromkeys(
        ("--rollout-health-check-first-wait",), "Launched engines join the pool only once they answer /health."
    ),
    **dict.fromkeys(("--distributed-backend", "--distributed-timeout-minutes"), "NCCL on GPU, gloo on CPU."),
    **dict.fromkeys(("--start-rollout-id",), "Resume with --load: the step is in the checkpoint."),
    **dict.fromkeys(("--disable-rollout-global-dataset",), "Use --data-source-path."),
    **dict.fromkeys(("--multimodal-keys",), "Text prompts only."),
    **dict.fromkeys(
        ("--rollout-max-context-len",),
        "Bound prompts with --rollout-max-prompt-len and responses with --rollout-max-response-len.",
    ),
    **dict.fromkeys(
        ("--log-probs-max-tokens-per-gpu",),
        "Log-probs use the training micro-batches; --log-probs-chunk-size bounds their memory.",
    ),
    **dict.fromkeys(("--ref-update-interval",), "Not supported."),
    **dict.fromkeys(("--skip-eval-before-train",), "Eval sets are always evaluated before training (step 0)."),
    **dict.fromkeys(
        ("--eval-max-context-len",),
        "slime's built-in evaluation does not read it either (only its multi-agent example): bound prompts "
        "with --eval-max-prompt-len and responses with --eval-max-response-len.",
    ),
    **dict.fromkeys(
        ("--eval-function-path", "--custom-eval-rollout-log-function-path"),
        "Evaluation runs the buffer's eval sets through the gateway's engines (each set's settings from "
        "--eval-config), and its results come back to the launcher (eval.jsonl, TensorBoard, W&B); a custom "
        "generation is --custom-generate-function-path.",
    ),
    **dict.fromkeys(
        ("--ckpt-format", "--no-save-optim", "--async-save"),
        "A checkpoint is Megatron's per-rank layout with the optimizer, written before the step goes on "
        "(--save); --save-hf adds an HF folder.",
    ),
    **dict.fromkeys(
        ("--custom-config-path",), "Give the settings as flags; settings of a reward function go in --custom-rm-args."
    ),
    **dict.fromkeys(
        ("--rollout-sample-hook-path", "--rollout-data-postprocess-path", "--loss-mask-type"),
        "A generate function returns finished samples, loss masks included.",
    ),
    **dict.fromkeys(
        (
            "--load-debug-rollout-data-subsample",
            "--save-debug-train-data",
            "--dump-details",
            "--check-weight-update-equal",
            "--record-memory-history",
            "--profile-target",
        ),
        "Weight equality after a sync is covered by the tests (docs/trainer.md).",
    ),
    **dict.fromkeys(
        ("--log-multi-turn", "--log-passrate", "--log-reward-category", "--log-correct-samples"),
        "A step's metrics are the trainer's means (steps.jsonl), with no per-sample turns, categories or pass"
        " rates; evaluations log pass@k (eval/<set>-pass@k).",
    ),
    **dict.fromkeys(
        ("--use-tensorboard", "--tb-project-name", "--tb-experiment-name"),
        "TensorBoard is always written, in the run folder.",
    ),
    **dict.fromkeys(
        ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "--use-precision-aware-optimizer"),
        "Not built: megatron-core 0.16.1's CPU offload (HybridDeviceOptimizer) works through CUDA streams and"
        " its own state handling, outside the path the trainer runs and tests.",
    ),
    **dict.fromkeys(("--lr-warmup-fraction",), "Give the warmup in steps: --lr-warmup-iters."),
    **dict.fromkeys(("--fp16",), "Train in bf16 (--bf16) or float32: fp16's loss scaling is not built."),
    **dict.fromkeys(
        ("--model-name", "--custom-model-provider-path", "--spec"), "The architecture is read from config.json."
    ),
}
