"""Check and time the fused decode projection kernel (pallas_kernels/decode_linear.py) on the GPU.

    python -m benchmarks.devtools.decode_linear_probe --out $OUT/decode_linear.json

check: the compiled kernel (output NaN-poisoned first) against its jnp reference run by XLA, per
Qwen2.5 layer call (q/k/v with norm, bias and LoRA; o_proj and down_proj with the residual;
gate/up with norm and SiLU x up), rows 1, 5 and 16 (ragged tiles), each `lora_down`;
bench: per call and rows, the kernel (with --sweep, its fastest of SWEEP's tile configs) against the same computation as XLA compiles it from the
reference (the rollout's path without the kernel: its matmul, the adapter's second matmul, the
norm, the epilogue), `benchmarks.kernels.time_ops` (weight copies rotated past L2), and the
kernel's share of the memory limit (its weight bytes / 4.8 TB/s, the H200's).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from benchmarks import kernels as kb
from pallas_kernels import decode_linear as dl

HBM_BYTES_PER_S = 4.8e12
RANK = 16


def calls(model: str) -> list[dict]:
    """The four kernel calls of one layer: name, n (W's projection rows), K, LoRA rank, options."""
    c = kb.MODELS[model]
    q, kv = c["heads"] * c["hd"], c["kv"] * c["hd"]
    return [
        dict(name="qkv", n=q + 2 * kv, k=c["hidden"], rank=3 * RANK, bias=True, norm=True, epilogue="none"),
        dict(name="o", n=c["hidden"], k=q, rank=RANK, bias=False, norm=False, epilogue="residual"),
        dict(name="gate_up", n=2 * c["inter"], k=c["hidden"], rank=2 * RANK, bias=False, norm=True, epilogue="silu_mul"),
        dict(name="down", n=c["hidden"], k=c["inter"], rank=RANK, bias=False, norm=False, epilogue="residual"),
    ]


def inputs(key, call: dict, m: int):
    ks = iter(jax.random.split(key, 8))
    n, k, r = call["n"], call["k"], call["rank"]
    normal = lambda shape, s: (s * jax.random.normal(next(ks), shape)).astype(jnp.bfloat16)  # noqa: E731
    x = normal((m, k), 3.0 if call["norm"] else 1.0)
    w = normal((n + r, k), k**-0.5)
    kw = dict(n=n, lora_b_NxR=normal((n, r), 0.05), lora_scale=2.0, epilogue=call["epilogue"])
    if call["bias"]:
        kw["bias_N"] = normal((n,), 0.3)
    if call["norm"]:
        kw["norm_K"] = 1.0 + 0.1 * jax.random.normal(next(ks), (k,), jnp.float32)
    if call["epilogue"] == "residual":
        kw["residual_MxN"] = normal((m, n), 1.0)
    return x, w, kw


def check(args, res):
    for model in args.models.split(","):
        for call in calls(model):
            for m, down in ((1, "kernel"), (5, "kernel"), (16, "kernel"), (1, "xla"), (5, "xla"), (16, "xla")):
                x, w, kw = inputs(jax.random.key(m), call, m)
                kernel = functools.partial(dl.decode_linear, poison=True, interpret=False, lora_down=down, **kw)
                got = jax.jit(kernel)(x, w)
                want = jax.jit(functools.partial(dl.decode_linear_reference, **kw))(x, w)
                got32, want32 = got.astype(jnp.float32), want.astype(jnp.float32)
                err = float(jnp.linalg.norm(got32 - want32) / jnp.linalg.norm(want32))
                row = dict(model=model, call=call["name"], m=m, lora_down=down, rel_err=err, finite=bool(jnp.isfinite(got32).all()))
                row["ok"] = row["finite"] and err < 8e-3  # a bf16 rounding of each output apart
                res["check"].append(row)
                print("CHECK", json.dumps(row), flush=True)


SWEEP = [  # (lora_down, bn, bk, num_warps, num_stages)
    ("xla", bn, bk, warps, stages)
    for bn, bk in ((16, 256), (32, 256), (64, 128), (64, 256), (128, 128))
    for warps in (4, 8)
    for stages in (3, 5)
]


def bench(args, res):
    for model in args.models.split(","):
        for call in calls(model):
            if args.calls and call["name"] not in args.calls.split(","):
                continue
            for m in [int(v) for v in args.ms.split(",")]:
                if time.time() - args.t0 > args.deadline:
                    print("deadline", flush=True)
                    return
                x, w, kw = inputs(jax.random.key(7), call, m)
                copies = max(8, int(3 * kb.L2_BYTES // (w.size * 2)) + 1)  # one executable: weights rotate past L2
                group = [(x, w + i * 0) for i in range(copies)]
                arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
                static = {k: v for k, v in kw.items() if not isinstance(v, jax.Array)}

                def op(fn, x, w, arrays=arrays, static=static, **tuning):
                    return fn(x, w, **arrays, **static, **tuning)

                xla_s = kb.time_ops(functools.partial(op, dl.decode_linear_reference), [group])["s"]
                configs = SWEEP if args.sweep else [None]
                timed = {}
                for cfg in configs:
                    tuning = {} if cfg is None else dict(zip(("lora_down", "bn", "bk", "num_warps", "num_stages"), cfg))
                    try:
                        timed[cfg] = kb.time_ops(functools.partial(op, dl.decode_linear, **tuning), [group])["s"]
                    except Exception as e:  # noqa: BLE001
                        print("ERROR", model, call["name"], m, cfg, str(e)[:300], flush=True)
                best = min(timed, key=timed.get)
                kernel_s = timed[best]
                weight_bytes = w.size * 2
                row = dict(
                    model=model, call=call["name"], m=m, n=call["n"], k=call["k"], kernel_us=kernel_s * 1e6,
                    best=best, default_us=timed.get(None, timed.get(SWEEP[0], float("nan"))) * 1e6,
                    all_us={str(c): t * 1e6 for c, t in timed.items()},
                    xla_us=xla_s * 1e6, xla_over_kernel=xla_s / kernel_s,
                    kernel_of_limit=weight_bytes / HBM_BYTES_PER_S / kernel_s,
                )  # fmt: skip
                res["bench"].append(row)
                print(
                    f"{model:5} {call['name']:8} M={m:2} kernel {row['kernel_us']:7.1f} us {best}  xla {row['xla_us']:7.1f} us"
                    f"  xla/kernel {row['xla_over_kernel']:.2f}  kernel {100 * row['kernel_of_limit']:.0f}% of limit",
                    flush=True,
                )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/decode_linear.json")
    ap.add_argument("--models", default="1.5B,7B")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--calls", default="", help="bench only these calls (qkv,o,gate_up,down); default all")
    ap.add_argument("--sections", default="check,bench")
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--sweep", action="store_true", help="time each SWEEP config; report the fastest")
    args = ap.parse_args()
    args.t0 = time.time()
    res = {"env": dict(jax=jax.__version__, device=str(jax.devices()[0])), "check": [], "bench": []}
    try:
        if "check" in args.sections:
            check(args, res)
        if "bench" in args.sections:
            bench(args, res)
    finally:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"checks: {len(res['check']) - len(bad)} ok, {len(bad)} failed", flush=True)


if __name__ == "__main__":
    main()
