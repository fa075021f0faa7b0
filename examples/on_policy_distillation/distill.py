"""slime's pure on-policy distillation, as its `post_process_rewards` does it: the trainer gets 0 as every sample's
reward, so its only learning signal is the distillation term (--use-opd); the task's reward is still reported (the
raw rewards), which shows the student learning the task from the teacher alone.
`--custom-reward-post-process-path examples/on_policy_distillation/distill.py:pure_distillation`."""


def pure_distillation(args, samples):
    raw = [float(sample.reward) for sample in samples]
    return raw, [0.0] * len(samples)
