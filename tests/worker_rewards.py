"""Rewards the tests name as "worker_rewards:<function>": imported by name in the reward workers, so
this module imports nothing heavy (a test module importing jax and torch would cost each worker
seconds)."""

import os
import time
import uuid
import zlib


def digit_reward(completion: str, ground_truth: str) -> float:
    """A reward learnable from scratch: the share of digit characters (up to 8) in the completion."""
    del ground_truth
    return min(sum(ch.isdigit() for ch in completion), 8) / 8.0


def prompt_reward(completion: str, ground_truth: str, prompt: str, source_id: str) -> float:
    """A reward reading the row's fields: the prompt's length / 1000, + 1 when the row has an id."""
    del completion, ground_truth
    return len(prompt) / 1000 + float(bool(source_id))


def sleepy_exact(completion: str, ground_truth: str) -> float:
    """1.0 when the completion is the answer, else 0.0; a completion "sleep <seconds> ..." first sleeps
    that long (a slow reward)."""
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
    return float(completion == ground_truth)


CALLS_BEFORE_FAILING = 16  # configs/tiny.py's completions per step: 4 prompts x 4


def fails_after_one_step(completion: str, ground_truth: str) -> float:
    """digit_reward for a step's worth of completions, then it raises on every one (a reward service
    gone down). Calls are counted as files in $QERL_TEST_FAULT_DIR (across workers). A boxed answer
    (the start-up check's sample completion; a random model writes none) is scored, not counted."""
    if "\\boxed{" not in completion:
        calls = os.environ["QERL_TEST_FAULT_DIR"]
        open(os.path.join(calls, uuid.uuid4().hex), "x").close()
        if len(os.listdir(calls)) > CALLS_BEFORE_FAILING:
            raise ConnectionError("the reward service is down")
    return digit_reward(completion, ground_truth)


def hashed_reward(completion: str, ground_truth: str) -> float:
    """1.0 for about a fifth of completions, by a hash of the text: groups of 4 vary about 60% of the time."""
    del ground_truth
    return float(zlib.crc32(completion.encode()) % 5 == 0)
