"""A reward whose module takes seconds to import (as one importing torch on a loaded machine), for
tests/test_reward_pool.py: its import in a worker must not count against the pool's per-item timeout."""

import time

IMPORT_SECONDS = 3.0
time.sleep(IMPORT_SECONDS)


def exact(completion: str, ground_truth: str) -> float:
    return 1.0 if completion == ground_truth else 0.0
