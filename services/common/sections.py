"""The sections settings are listed under in every command's `--help` (and `slipstream train --help-all`): a setting
of a nested group takes its group's section (the trainer's `loss.*`: algorithm), any other the first name rule it
matches, so that a new setting usually lands in its place without an entry here. The order is a slime user's: what to
train and on what first, the machinery last."""

import fnmatch

SECTIONS = {
    "model": "model and checkpoints",
    "data": "data",
    "rollout": "rollout and batches",
    "reward": "reward",
    "algorithm": "algorithm",
    "optimisation": "optimisation",
    "parallelism": "GPUs and parallelism",
    "weight sync": "weight sync",
    "evaluation": "evaluation",
    "deployment": "deployment (addresses, engines, Redis, security, timeouts)",
    "logging": "logging and debugging",
    "other": "other settings",  # none of the rules: tests/train/test_help.py wants every flag placed
}
# A nested group's settings, whatever their names (the optimizer's --weight-decay is not weight sync).
GROUPS = {
    "loss": "algorithm",
    "optimizer": "optimisation",
    "parallel": "parallelism",
    "redis": "deployment",
    "tls": "deployment",
    "auth": "deployment",
}
# Field-name patterns (fnmatch), tried in this order: the first that matches places the setting. A section may come
# twice when a narrower rule of another must sit between (rm_grpc_addr is the reward's, reward_addr an address).
RULES = (
    ("logging", ("*debug*", "*wandb*", "tensorboard_dir", "log_samples", "log_level", "log_format", "*_log_*",
                 "steps_file", "run_id", "output_dir")),
    ("evaluation", ("eval_*", "*_eval_*")),
    ("algorithm", ("*opd*", "moe_*", "*routing_replay*", "*routed_experts*", "*advantage*", "*critic*", "*_loss*",
                   "*_tis_*", "*grpo*", "*rewards_normalization", "kl_coef", "gamma", "lambd", "value_clip",
                   "custom_convert_samples_to_train_data_path")),
    ("reward", ("rm_*", "*_rm*")),
    ("weight sync", ("*weight*", "pause_mode", "buffer_mib")),
    ("deployment", ("host", "port", "*_port", "*_addr", "*_urls", "engine_url", "*api_key*", "allowed_*",
                    "*health_check*", "*timeout*", "*_retries", "grace_period_s", "max_message_mb", "keepalive_*",
                    "engine_discovery*", "fleet_*", "use_router", "*lease_seconds", "expire_interval_s",
                    "use_fault_tolerance")),
    ("reward", ("*reward*", "num_workers")),
    ("model", ("hf_checkpoint", "load", "save", "save_*", "*lora*", "target_modules", "model_path", "dtype")),
    ("parallelism", ("*parallel*", "*num_gpus*", "actor_*", "colocate", "offload_*", "*gpu_id*", "tp_size", "device",
                     "balance_data", "use_distributed_optimizer", "overlap_*", "ddp_*")),
    ("data", ("prompt_data", "data_source_path", "streaming_data", "num_data_workers", "skip_invalid_rows", "*_key",
              "*chat_template*", "rollout_shuffle", "rollout_seed", "num_epoch", "rollout_max_prompt_len")),
    ("optimisation", ("micro_batch_size", "*dynamic_batch*", "max_tokens_per_gpu", "recompute*", "bf16",
                      "compile_model", "log_probs_chunk_size", "log_probs_from_hidden", "seed")),
    ("rollout", ("rollout_*", "n_samples_*", "*batch_size", "num_steps_per_rollout", "num_rollout", "*filter*",
                 "*stale*", "max_buffered_groups", "*partial*", "*generate*", "max_turns", "*concurrency*",
                 "affinity_slack", "max_running_requests", "sglang_args", "async_buffer_size")),
)  # fmt: skip


def section_of(name: str, groups: tuple[str, ...] = ()) -> str:
    """The section of setting `name` (a field's name: `eps_clip`, `context_parallel_size`), nested in `groups`."""
    for group in groups:
        if group in GROUPS:
            return GROUPS[group]
    for section, patterns in RULES:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return section
    return "other"
