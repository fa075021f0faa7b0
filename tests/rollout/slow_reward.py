"""A reward function whose module takes seconds to import, as one that loads a reward model does
(tests/rollout/test_scale.py): a reward service must have it loaded in its workers before it says it is ready."""

import random
import time

time.sleep(6.0)


def reward(args, sample) -> float:
    return random.random()
