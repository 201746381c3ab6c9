"""What a first rollout call compiles, and how long each program takes to trace, lower and compile
for an H100, on a machine without a GPU.

    pip install "jax-cuda12-plugin==$JAXV" "jax-cuda12-pjrt==$JAXV"   # XLA's GPU compiler; no GPU needed
    JAX_PLATFORMS=cpu python -m benchmarks.devtools.compile_census --size 1.5B --formats bf16,nvfp4 --rows 128

For each format, the programs `generate` compiles in its first call, with shape-only Qwen2.5
weights and the copies it makes on a Hopper GPU (`hlo_census.rollout_setup`):
- the weight preparation (`rollout.weights.split_layers`): every jitted program it calls, recorded
  while it runs on shapes, one row per distinct program (function and argument shapes) with the
  number of calls;
- the admission of the first row bucket, the decode of every bucket and the compactions.
Each is traced, lowered (JAX's Python work, also paid on a warm persistent cache: the cache key
is the lowered program) and compiled for the H100 (deviceless AOT, Pallas kernels as kernels).

What it cannot see: XLA's autotuning and the loading of the kernels, which need the GPU, and
the GPU machine's faster CPU. So the numbers are this CPU's work, for comparing formats and
changes side by side; `benchmarks.rollout` times the first call on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from benchmarks.devtools import hlo_census


def _program_attributes(module) -> dict[str, Any]:
    """The module's jitted programs: {attribute name: jit-wrapped function}."""
    return {n: f for n, f in vars(module).items() if callable(getattr(f, "trace", None)) and hasattr(f, "lower")}


@contextlib.contextmanager
def recording_programs(module, device):
    """While inside, each jitted program of `module` records its calls: yields {(name, argument
    signature): [calls, shape-only arguments placed on `device`]}; the calls still run (on shapes,
    under `jax.eval_shape`)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    sharding = jax.sharding.SingleDeviceSharding(device)

    def as_spec(x):
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        return x

    calls: dict[tuple[str, str], list[Any]] = {}
    originals = _program_attributes(module)

    def recorder(name, fn):
        def call(*args):
            specs = jax.tree.map(as_spec, args)
            signature = str(jax.tree.map(lambda s: (s.shape, str(s.dtype)) if hasattr(s, "shape") else s, specs))
            entry = calls.setdefault((name, signature), [0, specs])
            entry[0] += 1
            return fn(*args)

        return call

    for name, fn in originals.items():
        setattr(module, name, recorder(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def _timed(fn, args: tuple) -> dict[str, float]:
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return dict(trace_s=round(t1 - t0, 2), lower_s=round(t2 - t1, 2), compile_s=round(t3 - t2, 2))


def census(fmt: str, args, device) -> list[dict[str, Any]]:
    """One row per program of `fmt`'s first rollout call: name, rows, calls, trace / lower / compile s."""
    import jax  # noqa: PLC0415

    from qerl_jax.rollout import weights  # noqa: PLC0415

    jax.clear_caches()  # a program another format compiled first would come back at once
    with recording_programs(weights, device) as prepared:
        setup = hlo_census.rollout_setup(
            args.size, fmt, args.rows, prompt_len=args.prompt_len, new_slots=args.new_slots,
            lora_rank=args.lora_rank, device=device, group_size=args.group_size,
        )  # fmt: skip
    jobs = [(name.strip("_").removesuffix("_jit"), None, count, getattr(weights, name), specs)
            for (name, _), (count, specs) in prepared.items()]  # fmt: skip
    for name, bucket, fn, fn_args in hlo_census.rollout_programs(setup, device):
        jobs.append((name, bucket, 1, fn, (setup["static"], *fn_args)))
    rows = []
    for name, bucket, count, fn, fn_args in jobs:
        with hlo_census.as_if_hopper():
            row = dict(format=fmt, program=name, rows=bucket, calls=count, **_timed(fn, fn_args))
        rows.append(row)
        print(
            f"{fmt:>6} {name:>14} {bucket or '':>5} x{count:<3} trace {row['trace_s']:6.2f}"
            f"  lower {row['lower_s']:6.2f}  compile {row['compile_s']:6.2f} s",
            flush=True,
        )
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{format: {trace_s, lower_s, compile_s, programs}} summed over its programs."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        t = out.setdefault(r["format"], dict(programs=0, trace_s=0.0, lower_s=0.0, compile_s=0.0))
        t["programs"] += 1
        for k in ("trace_s", "lower_s", "compile_s"):
            t[k] = round(t[k] + r[k], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hlo_census.add_rollout_args(parser, size="1.5B", rows=128, new_slots=768)
    args = parser.parse_args(argv)

    import jax  # noqa: PLC0415

    device = hlo_census.h100_device()
    print(f"jax {jax.__version__}, compiled for {device.device_kind} on this machine's CPU")
    rows = [r for fmt in args.formats.split(",") for r in census(fmt, args, device)]
    summary = totals(rows)
    for fmt, t in summary.items():
        print(f"{fmt}: {t['programs']} programs, trace {t['trace_s']} s, lower {t['lower_s']} s, "
              f"compile {t['compile_s']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), jax=jax.__version__, rows=rows, totals=summary), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
