"""A whole rollout function (`--rollout-function-path examples/slime_plugins/rollout.py:generate_rollout`) written as
slime's are: `generate_rollout(args, rollout_id, data_source, evaluation=False)` returns the step's groups of
samples.

It takes `args.rollout_batch_size` groups from the data source and generates every sample with one request each to
the SGLang router at `args.sglang_router_ip:args.sglang_router_port` (token ids in and out, with log-probs), many at
once. Rewards are left unset, so the reward service scores them.
"""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert not evaluation, "evaluation has its own function (--eval-function-path)"
    groups = data_source.get_samples(args.rollout_batch_size)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sampling_params = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "max_new_tokens": args.rollout_max_response_len,
    }
    samples = [sample for group in groups for sample in group]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda sample: _generate(url, sample, sampling_params), samples))
    return groups


def _generate(url, sample, sampling_params):
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        output = json.loads(response.read())
    meta = output["meta_info"]
    sample.tokens = sample.tokens + output["output_ids"]
    sample.response = output["text"]
    sample.response_length = len(output["output_ids"])
    sample.loss_mask = [1] * sample.response_length
    sample.rollout_log_probs = [entry[0] for entry in meta["output_token_logprobs"]]
    sample.weight_versions.append(meta["weight_version"])
    finish = meta["finish_reason"]["type"]
    sample.status = {"stop": sample.Status.COMPLETED, "length": sample.Status.TRUNCATED}.get(
        finish, sample.Status.ABORTED
    )
