"""Diagnostic: how fast can a Pallas (Triton) program stream a packed weight matrix with a
given tiling, with no decode and no dot? Each program reads [bn, bkb] tiles of the codes
(uint8 [N, K/2], or the same bytes as int32 words) over its K range and writes row sums.

    python -m benchmarks.devtools.stream_probe --out $OUT/stream.json

Compared side by side with a bf16 `jnp.dot` of the same weight shape at M=16 and an XLA
row-sum of the codes, in one process (the ratio is what matters).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.kernels import make_groups, n_copies, time_ops

SHAPES = {"7B gate": (18944, 3584), "7B down": (3584, 18944), "7B q": (3584, 3584)}
# (bn, bk bytes per row per step, warps, stages, split, words)
CONFIGS = [
    (64, 128, 4, 1, 2, False),
    (64, 128, 4, 4, 2, False),
    (64, 256, 4, 1, 2, False),
    (64, 256, 8, 1, 2, False),
    (128, 256, 8, 1, 1, False),
    (32, 256, 4, 1, 4, False),
    (64, 512, 8, 1, 1, False),
    (16, 512, 4, 1, 4, False),
    (64, 256, 4, 1, 2, True),
    (128, 512, 8, 1, 1, True),
    (32, 1024, 8, 1, 2, True),
]


def _stream_kernel(c_ref, o_ref, *, bn, bkb, steps, n):
    n0 = pl.program_id(0) * bn
    ks = pl.program_id(1)

    def body(i, acc):
        k0 = pl.multiple_of((ks * steps + i) * bkb, bkb)
        return acc + c_ref[pl.ds(n0, bn), pl.ds(k0, bkb)].astype(jnp.int32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bkb), jnp.int32))
    o_ref[pl.ds(ks * n + n0, bn)] = jnp.sum(acc, axis=1)


def stream(
    codes: jax.Array, bn: int, bkb: int, warps: int, stages: int, split: int, interpret: bool = False
) -> jax.Array:
    """Row sums [split * N] int32 of codes [N, C] (C bytes, or C / 4 int32 words)."""
    n, c = codes.shape
    if n % bn or c % (bkb * split):
        raise ValueError(f"tiling {bn}x{bkb} split {split} does not divide {codes.shape}")
    steps = c // (bkb * split)
    return pl.pallas_call(
        functools.partial(_stream_kernel, bn=bn, bkb=bkb, steps=steps, n=n),
        out_shape=jax.ShapeDtypeStruct((split * n,), jnp.int32),
        grid=(n // bn, split),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name="stream_probe",
        interpret=interpret,
    )(codes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="stream.json")
    args = ap.parse_args()
    rows = []
    for label, (n, k) in SHAPES.items():
        key = jax.random.PRNGKey(n + k)
        nbytes = n * k // 2
        r = n_copies(nbytes)
        u = min(16, r)
        cs = [
            jax.random.randint(jax.random.fold_in(key, i), (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
            for i in range(r)
        ]
        ws = [jax.lax.bitcast_convert_type(c.reshape(n, k // 8, 4), jnp.int32) for c in cs]
        w_bf16 = [jnp.full((n, k), i, jnp.bfloat16) for i in range(n_copies(2 * n * k))]
        x = jnp.ones((16, k), jnp.bfloat16)
        bf = time_ops(
            lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
            make_groups([(x, w) for w in w_bf16], min(16, len(w_bf16))),
        )["s"]
        del w_bf16
        xla = time_ops(lambda c: jnp.sum(c.astype(jnp.int32), axis=1), make_groups([(c,) for c in cs], u))["s"]
        base = dict(
            shape=label,
            n=n,
            k=k,
            code_MB=nbytes / 1e6,
            bf16_dot_M16_us=bf * 1e6,
            bf16_GBps=2 * n * k / bf / 1e9,
            xla_rowsum_us=xla * 1e6,
            xla_rowsum_GBps=nbytes / xla / 1e9,
        )
        print(json.dumps(base), flush=True)
        rows.append(base)
        for bn, bkb, warps, stages, split, words in CONFIGS:
            row = dict(shape=label, bn=bn, bk_bytes=bkb, warps=warps, stages=stages, split=split, words=words)
            try:
                arrs = ws if words else cs
                width = bkb // 4 if words else bkb
                t = time_ops(
                    lambda c, width=width, bn=bn, warps=warps, stages=stages, split=split: stream(
                        c, bn, width, warps, stages, split
                    ),
                    make_groups([(a,) for a in arrs], u),
                )["s"]
                row.update(us=t * 1e6, GBps=nbytes / t / 1e9, vs_bf16_dot=bf / t)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del cs, ws
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
