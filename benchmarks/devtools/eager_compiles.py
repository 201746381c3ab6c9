"""What eager ops on host data cost the first time they meet a shape: `jnp.asarray` of a numpy array
and a numpy-indexed gather of a device array each compile a program per new shape; `jax.device_put`
and selecting on the host then putting compile nothing. A rollout whose row count moves from step to
step met new shapes in its output fields (KERNEL_NOTES, "Toolchain pitfalls").

    python -m benchmarks.devtools.eager_compiles --out $OUT/eager_compiles.json   # any device

For each row count (each a new shape): the time of `jnp.asarray` (first call), `jax.device_put`, the
first and a second numpy-indexed gather of --select rows on the device, and the same rows selected on
the host and put, each synchronized.
"""

from __future__ import annotations

import argparse
import json
import time


def _timed(fn) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    return (time.perf_counter() - start) * 1e3


def measure(rows: list[int], width: int, select: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.block_until_ready(jnp.zeros(3) + 1)  # the backend up
    index = np.arange(select)
    out = []
    for n in rows:
        x = np.zeros((n, width), np.int32)
        row = {"rows": n, "asarray_ms": _timed(lambda x=x: jnp.asarray(x))}
        row["device_put_ms"] = _timed(lambda x=x: jax.device_put(x))
        on_device = jax.device_put(x)
        row["gather_first_ms"] = _timed(lambda a=on_device: a[index])
        row["gather_again_ms"] = _timed(lambda a=on_device: a[index])
        row["host_select_put_ms"] = _timed(lambda a=on_device: jax.device_put(np.asarray(a)[index]))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="472,504,512,496,480", help="row counts, each a new shape")
    ap.add_argument("--width", type=int, default=2048, help="columns (a rollout's response slots)")
    ap.add_argument("--select", type=int, default=256, help="rows gathered (a step's kept samples)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()
    import jax

    rows = measure([int(r) for r in args.rows.split(",")], args.width, min(args.select, *map(int, args.rows.split(","))))
    for r in rows:
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
