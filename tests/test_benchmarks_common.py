"""benchmarks/common.py: the decode-step arithmetic of the rollout benchmark."""

import pytest

from benchmarks.common import decode_step_seconds


def test_decode_step_from_the_fastest_calls_not_the_fastest_difference():
    # Rep 1's one-token call hit a hiccup (0.30 s): its own difference is ~0, the minimum of the
    # differences would report a 0 ms step. The fastest full call less the fastest one-token call
    # gives the real one.
    reps = [{"prefill_s": 0.10, "wall_s": 0.42}, {"prefill_s": 0.30, "wall_s": 0.30}]
    assert decode_step_seconds(reps, steps=33) == pytest.approx((0.30 - 0.10) / 32)


def test_decode_step_never_zero_or_negative():
    assert decode_step_seconds([{"prefill_s": 0.5, "wall_s": 0.4}], steps=2) > 0
