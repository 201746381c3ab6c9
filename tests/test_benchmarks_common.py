"""benchmarks/common.py: the decode-step arithmetic of the rollout benchmark; the compile timeline."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.common import decode_step_seconds


def test_decode_step_is_the_long_calls_extra_steps_and_the_host_work_cancels():
    # 2.4 ms steps; each call's host work varies from 60 to 190 ms (as measured on an H100 at 1.5B).
    step, host = 0.0024, [0.06, 0.19, 0.11]
    short = [{"steps": 32, "wall_s": h + 32 * step} for h in host]
    long = [{"steps": 160, "wall_s": h + 160 * step} for h in reversed(host)]
    assert decode_step_seconds(short, long) == pytest.approx(step)


def test_decode_step_never_zero_or_negative_and_needs_more_long_steps():
    assert decode_step_seconds([{"steps": 8, "wall_s": 0.5}], [{"steps": 24, "wall_s": 0.4}]) > 0
    with pytest.raises(ValueError, match="more steps"):
        decode_step_seconds([{"steps": 8, "wall_s": 0.1}], [{"steps": 8, "wall_s": 0.2}])


def test_covered_counts_overlapping_spans_once():
    from benchmarks.common import _covered

    assert _covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == 4.0
    assert _covered([]) == 0.0


def test_compile_timeline_records_a_fresh_programs_compile_and_not_a_cached_one():
    """A first call of a new jitted function adds one trace, lower and backend-compile span each,
    inside the window; a second call with the same shapes adds none."""
    import time

    from benchmarks.common import CompileTimeline

    timeline = CompileTimeline()
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0)
    x, y = jax.block_until_ready((jnp.ones((8, 8)), jnp.zeros((8, 8))))
    t0 = time.time()
    f(x).block_until_ready()
    t1 = time.time()
    first = timeline.summary(t0, t1)
    assert first["compiles"] == 1 and first["compile_s"] > 0
    assert sorted(kind for kind, _, _, end in timeline.spans if t0 <= end <= t1) == ["compile", "lower", "trace"]
    assert 0 < first["compile_wall_s"] <= first["compiling_wall_s"] <= t1 - t0 + 0.01
    # the one compile, rounded to 2 decimals from the raw span (compile_s is rounded to 3 first)
    assert first["longest_compiles"][0][1] == pytest.approx(first["compile_s"], abs=0.0051)
    assert first["other_s"] == pytest.approx(t1 - t0 - first["compiling_wall_s"], abs=0.011)
    t2 = time.time()
    f(y).block_until_ready()
    again = timeline.summary(t2, time.time())
    assert again["compiles"] == 0 and again["compile_s"] == 0
