"""Rewards that break their worker process once per run, for tests/test_train.py (imported by name in
the reward workers, so it imports nothing heavy).

The first call of the run's training (in any worker) SIGKILLs its worker, as the OOM killer would; the
second hangs past any timeout. Marker files in $QERL_TEST_FAULT_DIR make each fault happen exactly once.
The start-up check's sample completion (a boxed answer, which a random model never writes) is scored
without a fault.
"""

import os
import signal
import time


def kill_then_hang(completion: str, ground_truth: str) -> float:
    """The share of digit characters (up to 8), after the two faults."""
    del ground_truth
    for fault in ("kill", "hang") if "\\boxed{" not in completion else ():
        try:
            os.close(os.open(os.path.join(os.environ["QERL_TEST_FAULT_DIR"], fault), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    return min(sum(ch.isdigit() for ch in completion), 8) / 8.0
