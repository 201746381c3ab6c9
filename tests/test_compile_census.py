"""benchmarks/devtools/compile_census.py: recording the programs a call runs, and the totals.

Compiling for an H100 needs jax's CUDA plugin (not installed in CI); the recording is tested here
on a module of two jitted programs, run on shapes on the CPU.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.devtools import compile_census


def _module():
    double = jax.jit(lambda x: 2 * x)
    scaled = jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1)
    return types.SimpleNamespace(double_jit=double, scaled_jit=scaled, helper=lambda x: x, CONSTANT=3)


def test_recording_counts_each_distinct_program_and_restores_the_module():
    module = _module()
    originals = dict(vars(module))
    device = jax.devices("cpu")[0]

    def work(x):
        for layer in range(3):  # one program, three calls (a traced index)
            x = module.double_jit(x) + np.int32(layer)
        y = module.double_jit(x[:2])  # another shape: another program
        return module.scaled_jit(y, "bfloat16")

    with compile_census.recording_programs(module, device) as calls:
        out = jax.eval_shape(work, jax.ShapeDtypeStruct((4,), jnp.int32))
        assert module.double_jit is not originals["double_jit"]
    assert out.shape == (2,) and out.dtype == jnp.bfloat16  # the calls still ran, on shapes
    assert vars(module) == originals
    counts = sorted((name, count) for (name, _), (count, _) in calls.items())
    assert counts == [("double_jit", 1), ("double_jit", 3), ("scaled_jit", 1)]
    (_, specs), = [v for (name, _), v in calls.items() if name == "scaled_jit"]
    assert specs[1] == "bfloat16"  # a static argument stays as it was
    assert specs[0].shape == (2,) and specs[0].sharding.device_set == {device}
    lowered = module.scaled_jit.trace(*specs).lower()  # what the census compiles
    assert "bf16" in lowered.as_text()


def test_totals_sum_each_format():
    rows = [
        dict(format="bf16", trace_s=0.1, lower_s=0.2, compile_s=3.0),
        dict(format="nvfp4", trace_s=0.2, lower_s=1.0, compile_s=4.0),
        dict(format="nvfp4", trace_s=0.1, lower_s=0.5, compile_s=0.5),
    ]
    assert compile_census.totals(rows) == {
        "bf16": dict(programs=1, trace_s=0.1, lower_s=0.2, compile_s=3.0),
        "nvfp4": dict(programs=2, trace_s=0.3, lower_s=1.5, compile_s=4.5),
    }
