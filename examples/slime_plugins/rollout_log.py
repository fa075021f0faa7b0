"""A rollout log function (`--custom-rollout-log-function-path examples/slime_plugins/rollout_log.py:log_rollout_data`)
written as slime's are: `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`.

It appends one JSON line per step (the step, the samples' mean reward and response length, the rollout time) to the
file named by the environment variable ROLLOUT_LOG (default rollout_log.jsonl), and returns False: the default
logging goes on.
"""

import json
import os


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    line = {
        "rollout_id": rollout_id,
        "num_samples": len(samples),
        "mean_reward": sum(float(s.reward) for s in samples) / len(samples),
        "mean_response_length": sum(s.response_length for s in samples) / len(samples),
        "rollout_time": rollout_time,
    }
    with open(os.environ.get("ROLLOUT_LOG", "rollout_log.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
    return False
