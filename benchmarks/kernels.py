"""Check and time the Pallas W4A16 kernels on the GPU (one device call does everything).

    python -m benchmarks.kernels --out $OUT/kernels.json [--sections check,sweep,bench]

Sections:
- env / ceilings: device-to-device copy bandwidth (read + write), read-only bandwidth;
- check: kernel vs float32 reference on fresh random weights (all formats, both regimes,
  ragged shapes), output NaN-poisoned first; backward and custom_vjp gradient;
- sweep: a few tile configs per (M bucket, N, K) of the Qwen2.5-7B / 32B linears; the
  fastest become the autotune table (written into the JSON, applied for `bench`);
- bench: Qwen2.5-7B and -32B q/k/v/o, gate/up, down at M in {1, 8, 16, 32, 64, 256, 1024,
  4096}: median time of our kernel vs XLA bf16 dot vs XLA dequantize-then-dot, achieved
  GB/s on packed bytes, and the backward (dx = dy @ W).

Timing: each jitted executable runs U independent ops on different weight copies; a
batch dispatches every copy group back to back and blocks once; the median over batches
divided by the op count is reported. Weight copies are rotated so that their total size
is several times the 50 MB L2. Sections stop early at --deadline (seconds) and every
result so far is written to --out after each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

import pallas_kernels  # noqa: F401  (registers the package)
from pallas_kernels import autotune
from pallas_kernels.quant_matmul import backward_launch, dot_nt, forward_launch
from qerl_jax.quant import packed as P
from qerl_jax.quant.formats import REGISTRY

MODELS = {
    "1.5B": dict(hidden=1536, inter=8960, heads=12, kv=2, hd=128),
    "7B": dict(hidden=3584, inter=18944, heads=28, kv=4, hd=128),
    "32B": dict(hidden=5120, inter=27648, heads=40, kv=8, hd=128),
}
MODELS["tiny"] = dict(hidden=256, inter=512, heads=2, kv=1, hd=128)  # CPU smoke test (--interpret)
MS = (1, 8, 16, 32, 64, 256, 1024, 4096)
INTERPRET = False
L2_BYTES = 50 * 2**20
RESULTS: dict = {"env": {}, "check": [], "sweep": [], "bench": [], "bwd": [], "errors": []}
T_START = time.time()


def model_linears(name: str) -> list[tuple[str, int, int]]:
    c = MODELS[name]
    q, kv = c["heads"] * c["hd"], c["kv"] * c["hd"]
    return [
        ("q", q, c["hidden"]),
        ("k", kv, c["hidden"]),
        ("v", kv, c["hidden"]),
        ("o", c["hidden"], q),
        ("gate", c["inter"], c["hidden"]),
        ("up", c["inter"], c["hidden"]),
        ("down", c["hidden"], c["inter"]),
    ]


def unique_shapes(name: str) -> list[tuple[int, int]]:
    out = []
    for _, n, k in model_linears(name):
        if (n, k) not in out:
            out.append((n, k))
    return out


# ----------------------------------------------------------------------------- data


def rand_packed(key, n: int, k: int, fmt: str):
    """Random codes and positive finite scales (never zeros), random global scale."""
    k1, k2, k3 = jax.random.split(key, 3)
    block = REGISTRY[fmt].block_size
    codes = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    if fmt == "nvfp4":
        scales = jax.random.uniform(k2, (n, k // block), minval=2.0**-6, maxval=448.0).astype(jnp.float8_e4m3fn)
        gs = jax.random.uniform(k3, (), minval=100.0, maxval=3000.0)
    elif fmt == "mxfp4":
        scales = jax.random.randint(k2, (n, k // block), 112, 140, jnp.int32).astype(jnp.uint8)
        gs = jnp.float32(1.0)
    else:
        scales = jax.random.uniform(k2, (n, k // block), minval=0.01, maxval=2.0)
        gs = jnp.float32(1.0)
    return P.PackedWeight(codes, scales, gs.astype(jnp.float32), fmt)


def rand_x(key, m: int, k: int) -> jax.Array:
    return jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)


def packed_bytes(p) -> int:
    return int(p.codes.size + p.scales.size * p.scales.dtype.itemsize + 4)


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(out))):
        return float("nan")
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def ref_fwd(x, p):
    return jnp.dot(x.astype(jnp.float32), P.dequantize(p, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def ref_bwd(dy, p):
    return jnp.dot(dy.astype(jnp.float32), P.dequantize(p, jnp.float32), precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- timing


def time_ops(op, groups: list[list[tuple]], reps: int = 5, min_batch_s: float = 0.004) -> dict:
    """Median seconds per op; groups[g] is a list of U argument tuples run in one executable.

    A batch dispatches the executables back to back (cycling over the groups, so the
    weights in flight rotate) and blocks once at the end; its length is chosen so that
    the GPU work per batch (>= min_batch_s, >= 20 calls) hides host dispatch and the
    final synchronisation.
    """
    u = len(groups[0])
    inner = jax.jit(op)  # one lowering (and one Triton compile) shared by the U calls
    f = jax.jit(lambda *args: [inner(*a) for a in args])
    t0 = time.perf_counter()
    jax.block_until_ready(f(*groups[0]))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for g in groups:
        out = f(*g)
    jax.block_until_ready(out)
    per_call = (time.perf_counter() - t0) / len(groups)
    n_calls = int(min(400, max(20, len(groups), math.ceil(min_batch_s / max(per_call, 1e-6)))))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(n_calls):
            out = f(*groups[i % len(groups)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / (n_calls * u))
    del out
    return {"s": statistics.median(samples), "min_s": min(samples), "compile_s": compile_s, "ops": n_calls * u}


def n_copies(bytes_per_copy: int, cap: int = 64) -> int:
    return int(min(cap, max(2, math.ceil(3 * L2_BYTES / bytes_per_copy))))


def make_groups(items: list, u: int) -> list[list]:
    """Consecutive groups of u items (an incomplete last group is dropped)."""
    return [items[i : i + u] for i in range(0, len(items) // u * u, u)]


def deadline_passed(args, section: str = "") -> bool:
    limit = args.sweep_deadline if section == "sweep" and args.sweep_deadline else args.deadline
    return time.time() - T_START > limit


def save(args):
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def log_error(where: str, e: BaseException):
    msg = f"{where}: {type(e).__name__}: {e}"
    print("ERROR", msg[:2000], flush=True)
    RESULTS["errors"].append({"where": where, "error": msg[:4000], "trace": traceback.format_exc()[-4000:]})


# ----------------------------------------------------------------------------- sections


def section_env(args):
    env = RESULTS["env"]
    env["jax"] = jax.__version__
    env["devices"] = [str(d) for d in jax.devices()]
    env["device_kind"] = jax.devices()[0].device_kind
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    try:  # cudaMemcpy-style device-to-device copy and a read-only reduction, via torch
        import torch

        src = torch.randint(0, 2**30, (2**28,), dtype=torch.int32, device="cuda")
        dst = torch.empty_like(src)
        srcf = src.float()
        for name, fn, nbytes in (
            ("torch_copy_rw", lambda dst=dst, src=src: dst.copy_(src), 8 * 2**28),
            ("torch_read", lambda srcf=srcf: srcf.sum(), 4 * 2**28),
        ):
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(10):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 1e3)
            env[f"{name}_GBps"] = nbytes / statistics.median(ts) / 1e9
        del src, dst, srcf
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        env["torch_error"] = str(e)[:200]
    n = 2**28  # 1 GiB of uint32
    a = jnp.arange(n, dtype=jnp.uint32)
    copy = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    read = jax.jit(lambda a: jnp.bitwise_xor.reduce(a.reshape(-1, 1024), axis=0))
    for name, f, nbytes in (("copy_rw", copy, 2 * 4 * n), ("read", read, 4 * n)):
        jax.block_until_ready(f(a))
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            jax.block_until_ready(f(a))
            ts.append(time.perf_counter() - t)
        env[f"{name}_GBps"] = nbytes / statistics.median(ts) / 1e9
    del a
    print("ENV", json.dumps(env), flush=True)


def section_check(args, decode: str) -> bool:
    """Correctness on the GPU. Returns False if the PTX decode path is broken."""
    ok = True
    key = jax.random.PRNGKey(int(time.time()) % 100000)
    cases = [
        ("nvfp4", 1, 3584, 3584),
        ("nvfp4", 16, 512, 3584),
        ("nvfp4", 3, 200, 256),
        ("nvfp4", 64, 1024, 5120),
        ("nvfp4", 256, 3584, 3584),
        ("nvfp4", 1024, 512, 3584),
        ("nvfp4", 130, 200, 256),
        ("mxfp4", 1, 3584, 3584),
        ("mxfp4", 64, 200, 256),
        ("mxfp4", 1024, 1024, 5120),
        ("nf4", 16, 3584, 3584),
        ("nf4", 130, 200, 256),
        ("nf4", 1024, 512, 3584),
    ]
    bwd_cases = [
        ("nvfp4", 130, 200, 256),
        ("nvfp4", 16, 3584, 3584),
        ("nf4", 1024, 512, 3584),
        ("mxfp4", 4096, 1024, 5120),
    ]
    if args.check_quick:
        cases = [
            ("nvfp4", 1, 3584, 3584),
            ("nvfp4", 3, 200, 256),
            ("mxfp4", 64, 1024, 5120),
            ("nf4", 16, 512, 3584),
            ("nvfp4", 256, 3584, 3584),
            ("nf4", 130, 200, 256),
        ]
        bwd_cases = [("nvfp4", 130, 200, 256), ("mxfp4", 16, 3584, 3584)]
    if INTERPRET:  # CPU smoke test: tiny shapes only
        cases = [("nvfp4", 3, 200, 256), ("mxfp4", 64, 96, 128), ("nf4", 130, 48, 128)]
        bwd_cases = [("nvfp4", 130, 200, 256)]
    for fmt, m, n, k in cases:
        key, k1, k2 = jax.random.split(key, 3)
        p = rand_packed(k1, n, k, fmt)
        x = rand_x(k2, m, k)
        row = dict(kind="fwd", fmt=fmt, m=m, n=n, k=k, decode=decode)
        try:
            out = jax.jit(
                lambda x, c, s, g: forward_launch(x, c, s, g, fmt=REGISTRY[fmt], interpret=INTERPRET, decode=decode, poison=True)  # noqa: B023 (traced at once)
            )(x, p.codes, p.scales, p.global_scale)
            row["rel_err"] = rel_err(out, ref_fwd(x, p))
            row["cfg"] = autotune.get_config("fwd", m, n, k).to_dict()
        except Exception as e:  # noqa: BLE001
            log_error(f"check fwd {fmt} {m}x{n}x{k}", e)
            row["rel_err"] = float("nan")
        row["pass"] = bool(row["rel_err"] < 1e-2)
        ok &= row["pass"]
        RESULTS["check"].append(row)
        print("CHECK", json.dumps(row), flush=True)
    for fmt, m, n, k in bwd_cases:
        key, k1, k2 = jax.random.split(key, 3)
        p = rand_packed(k1, n, k, fmt)
        dy = rand_x(k2, m, n)
        row = dict(kind="bwd", fmt=fmt, m=m, n=n, k=k, decode=decode)
        try:
            out = jax.jit(
                lambda d, c, s, g: backward_launch(d, c, s, g, fmt=REGISTRY[fmt], interpret=INTERPRET, decode=decode, poison=True)  # noqa: B023 (traced at once)
            )(dy, p.codes, p.scales, p.global_scale)
            row["rel_err"] = rel_err(out, ref_bwd(dy, p))
        except Exception as e:  # noqa: BLE001
            log_error(f"check bwd {fmt} {m}x{n}x{k}", e)
            row["rel_err"] = float("nan")
        row["pass"] = bool(row["rel_err"] < 1e-2)
        ok &= row["pass"]
        RESULTS["check"].append(row)
        print("CHECK", json.dumps(row), flush=True)
    # custom_vjp through the public API
    try:
        key, k1, k2, k3 = jax.random.split(key, 4)
        n, k = (64, 128) if INTERPRET else (512, 3584)
        p = rand_packed(k1, n, k, "nvfp4")
        x = rand_x(k2, 8, k)
        g = jax.random.normal(k3, (8, n))
        gx = jax.grad(lambda x: jnp.sum(pallas_kernels.quant_matmul(x, p).astype(jnp.float32) * g))(x)
        want = jax.grad(lambda x: jnp.sum(ref_fwd(x, p) * g))(x)
        row = dict(kind="grad", fmt="nvfp4", m=8, n=n, k=k, rel_err=rel_err(gx, want))
        row["pass"] = bool(row["rel_err"] < 1e-2)
        ok &= row["pass"]
        RESULTS["check"].append(row)
        print("CHECK", json.dumps(row), flush=True)
    except Exception as e:  # noqa: BLE001
        log_error("check grad", e)
        ok = False
    save(args)
    return ok


def fwd_op(fmt, cfg, decode):
    return lambda x, c, s, g: forward_launch(x, c, s, g, fmt=REGISTRY[fmt], interpret=INTERPRET, decode=decode, cfg=cfg)


def bf16_copy_groups(packed, xs: list, u_cap: int = 16) -> list[list]:
    """(x, W) groups for the bf16 baseline: `packed`'s values in bf16 plus slightly shifted copies,
    rotated like the packed weights (n_copies), the xs reused in turn."""
    w0 = P.dequantize(packed, jnp.bfloat16)
    r = n_copies(w0.size * 2)
    ws = [w0] + [w0 + jnp.bfloat16(i * 1e-3) for i in range(1, r)]
    return make_groups([(xs[i % len(xs)], w) for i, w in enumerate(ws)], min(u_cap, r))


def packed_groups(key, m, n, k, fmt, u_cap=16):
    """Rotating argument groups for ops on packed weights: [[(x, codes, scales, gs), ...], ...]."""
    p0 = rand_packed(key, n, k, fmt)
    r = n_copies(packed_bytes(p0))
    u = min(u_cap, r)
    xs = [rand_x(jax.random.fold_in(key, 1000 + i), m, k) for i in range(u)]
    items = [p0] + [rand_packed(jax.random.fold_in(key, i), n, k, fmt) for i in range(1, r)]
    args = [(xs[i % u], p.codes, p.scales, p.global_scale) for i, p in enumerate(items)]
    return make_groups(args, u), items


SWEEP_DECODE = [  # split_k is added by autotune.split_rule unless given
    dict(bn=64, bk=256, num_warps=4, num_stages=4, swap=True),
    dict(bn=128, bk=256, num_warps=8, num_stages=3, swap=True),
    dict(bn=64, bk=512, num_warps=4, num_stages=3, swap=True),
    dict(bn=64, bk=256, num_warps=4, num_stages=4, swap=True, split_k=1),
    dict(bn=128, bk=128, num_warps=8, num_stages=4, swap=True),
    dict(bn=64, bk=128, num_warps=4, num_stages=5, swap=True),
    dict(bn=64, bk=256, num_warps=4, num_stages=4, swap=False),
    dict(bn=64, bk=256, num_warps=4, num_stages=6, swap=False),
    dict(bn=64, bk=512, num_warps=8, num_stages=4, swap=False),
    dict(bn=128, bk=256, num_warps=8, num_stages=4, swap=False),
    dict(bn=64, bk=256, num_warps=4, num_stages=4, swap=False, split_mult=2),
    dict(bn=64, bk=128, num_warps=4, num_stages=8, swap=False, split_mult=2),
    dict(bn=64, bk=256, num_warps=4, num_stages=4, swap=False, scale_words=False),  # control for --scale-words
    dict(bn=64, bk=256, num_warps=4, num_stages=1, swap=False),  # 13: no cp.async pipeline, plain loads
    dict(bn=64, bk=256, num_warps=8, num_stages=1, swap=False),
    dict(bn=128, bk=256, num_warps=8, num_stages=1, swap=False),
    dict(bn=32, bk=256, num_warps=4, num_stages=1, swap=False, split_mult=2),
    dict(bn=64, bk=512, num_warps=8, num_stages=2, swap=False),
    dict(bn=64, bk=256, num_warps=4, num_stages=2, swap=False, split_mult=2),
    dict(bn=128, bk=128, num_warps=8, num_stages=2, swap=False),
    # 20-26: the nvfp4 block kernel (M <= 32); split_programs: programs the split-K rule aims at
    dict(bn=64, bk=128, num_warps=4, num_stages=3, mode="block", split_programs=2.5),
    dict(bn=64, bk=128, num_warps=4, num_stages=2, mode="block", split_programs=2.5),
    dict(bn=64, bk=64, num_warps=4, num_stages=3, mode="block", split_programs=2.5),
    dict(bn=64, bk=128, num_warps=4, num_stages=3, mode="block", split_programs=4),
    dict(bn=64, bk=128, num_warps=4, num_stages=4, mode="block", split_programs=2.5),
    dict(bn=32, bk=128, num_warps=4, num_stages=3, mode="block", split_programs=2.5),
    dict(bn=128, bk=128, num_warps=8, num_stages=3, mode="block", split_programs=2.5),
    # 27-31: the block kernel with W as the dot's left operand (wgmma, W from registers)
    dict(bn=64, bk=128, num_warps=4, num_stages=3, mode="block", swap=True, split_programs=2.5),
    dict(bn=64, bk=64, num_warps=4, num_stages=3, mode="block", swap=True, split_programs=2.5),
    dict(bn=128, bk=128, num_warps=8, num_stages=3, mode="block", swap=True, split_programs=2.5),
    dict(bn=64, bk=128, num_warps=4, num_stages=4, mode="block", swap=True, split_programs=2.5),
    dict(bn=64, bk=256, num_warps=4, num_stages=3, mode="block", swap=True, split_programs=2.5),
    "table",  # 32: the autotune table's current entry for the shape (the control)
    # 33-36: the block kernel for the rollout's decode batch (M = 128 / 256: one M tile, wgmma N = M)
    dict(bn=64, bk=64, num_warps=8, num_stages=3, mode="block", swap=True, split_programs=1),
    dict(bn=64, bk=128, num_warps=8, num_stages=3, mode="block", swap=True, split_programs=1),
    dict(bn=64, bk=64, num_warps=8, num_stages=4, mode="block", swap=True, split_programs=2),
    dict(bn=64, bk=64, num_warps=4, num_stages=3, mode="block", swap=True, split_programs=1),
]
SWEEP_PREFILL = [
    dict(bm=128, bn=128, bk=64, num_warps=8, num_stages=3),
    dict(bm=128, bn=128, bk=64, mode="dequant"),
    dict(bm=64, bn=128, bk=64, num_warps=4, num_stages=4),
    dict(bm=128, bn=128, bk=128, num_warps=8, num_stages=3),
    dict(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, swap=True),
    dict(bm=256, bn=64, bk=64, num_warps=8, num_stages=3),  # W decoded once for all 256 rows
    dict(bm=128, bn=64, bk=128, num_warps=4, num_stages=4),
    dict(bm=256, bn=128, bk=64, num_warps=8, num_stages=3),
    dict(bm=128, bn=64, bk=128, num_warps=4, num_stages=4, swap=True),
]


def section_sweep(args, decode: str):
    entries = {}
    shapes = [(model, s) for model in args.models for s in unique_shapes(model)]
    first = args.models[0]
    plan = []
    for model, (n, k) in shapes:
        for m in args.sweep_decode_ms:
            if args.sweep_decode_cands:
                cands = [SWEEP_DECODE[i] for i in args.sweep_decode_cands]
            elif args.sweep_size == "full":
                cands = SWEEP_DECODE
            elif model == first:
                cands = [SWEEP_DECODE[i] for i in ((0, 1, 2, 6) if m <= 16 else (0, 1, 6))]
            elif m <= 16:
                cands = [SWEEP_DECODE[i] for i in (0, 1, 6)]
            else:
                continue
            plan.append(("fwd", m, n, k, cands))
    for model, (n, k) in shapes:
        if args.sweep_size != "full" and model != first and not args.sweep_prefill_cands:
            continue
        for m in args.sweep_prefill_ms:
            if args.sweep_prefill_cands:
                cands = [SWEEP_PREFILL[i] for i in args.sweep_prefill_cands]
            else:
                cands = SWEEP_PREFILL if args.sweep_size == "full" else [SWEEP_PREFILL[i] for i in (2, 1)]
            plan.append(("fwd", m, n, k, cands))
    if args.sweep_size == "full":
        for _model, (n, k) in shapes[:4]:
            plan.append(
                (
                    "bwd",
                    4096,
                    n,
                    k,
                    [
                        dict(bm=128, bn=0, bk=128, bc=64, num_warps=8, num_stages=3),
                        dict(bm=128, bn=0, bk=64, bc=64, num_warps=4, num_stages=4),
                        dict(bm=128, bn=0, bk=128, bc=64, mode="dequant"),
                    ],
                )
            )
    for kind, m, n, k, cands in plan:
        if deadline_passed(args, "sweep"):
            print("SWEEP deadline reached", flush=True)
            break
        key = jax.random.PRNGKey(m * 7 + n * 13 + k)
        try:
            groups, _ = packed_groups(key, m, n, k, "nvfp4")
            if kind == "bwd":  # dy [M, N] instead of x [M, K]
                dy = rand_x(jax.random.fold_in(key, 7), m, n)
                groups = [[(dy,) + a[1:] for a in g] for g in groups]
        except Exception as e:  # noqa: BLE001
            log_error(f"sweep data {m}x{n}x{k}", e)
            continue
        best = None
        for c in cands:
            base = autotune.default_config(kind, m, n, k)
            if c == "table":
                c = {f.name: getattr(autotune.get_config(kind, m, n, k), f.name) for f in dataclasses.fields(base)}
            c = dict(c)
            split_mult = c.pop("split_mult", 1)  # more programs than the rule gives (longer pipelines per SM)
            per_sm = c.pop("split_programs", 0.8)
            cfg = dataclasses.replace(base, **{"mode": "fused", **c})
            if kind == "fwd" and m <= autotune.DECODE_MAX_M and "split_k" not in c:
                split = autotune.split_rule(n, k, cfg.bn, cfg.bk, min_programs=per_sm * autotune.NUM_SMS)
                while split_mult > 1 and (k // cfg.bk) % (split * 2) == 0:
                    split, split_mult = split * 2, split_mult // 2
                cfg = dataclasses.replace(cfg, split_k=split)
            op = (
                fwd_op("nvfp4", cfg, decode)
                if kind == "fwd"
                else (
                    lambda d, cc, s, g, cfg=cfg: backward_launch(
                        d, cc, s, g, fmt=REGISTRY["nvfp4"], interpret=INTERPRET, decode=decode, cfg=cfg
                    )
                )
            )
            row = dict(kind=kind, m=m, n=n, k=k, cfg=cfg.to_dict())
            try:
                t = time_ops(op, groups)
                row.update(us=t["s"] * 1e6, compile_s=t["compile_s"])
                # every candidate is checked against the float32 reference (NaN fails too)
                a0, c0, s0, g0 = groups[0][0]
                ref = (ref_fwd if kind == "fwd" else ref_bwd)(a0, P.PackedWeight(c0, s0, g0, "nvfp4"))
                row["rel_err"] = rel_err(jax.jit(op)(a0, c0, s0, g0), ref)
                if not row["rel_err"] <= 1e-2:
                    log_error(f"sweep {kind} {m}x{n}x{k} {c}", ValueError(f"rel_err {row['rel_err']:.3g}"))
                elif best is None or t["s"] < best[0]:
                    best = (t["s"], cfg)
            except Exception as e:  # noqa: BLE001
                log_error(f"sweep {kind} {m}x{n}x{k} {c}", e)
                row["us"] = None
            RESULTS["sweep"].append(row)
            print("SWEEP", json.dumps(row), flush=True)
        if best is not None:
            entries[autotune.key(kind, m, n, k)] = best[1].to_dict()
            autotune._table()[autotune.key(kind, m, n, k)] = best[1].to_dict()
        del groups
        RESULTS["autotune_entries"] = entries
        save(args)


def pl_cdiv(a, b):
    return -(-a // b)


def bench_fwd(args, decode: str, ms: list[int]):
    env = RESULTS["env"]
    copy_bw = env.get("torch_copy_rw_GBps") or env.get("copy_rw_GBps")
    read_bw = env.get("torch_read_GBps") or env.get("read_GBps")
    done = set((r["m"], r["n"], r["k"]) for r in RESULTS["bench"])
    for m in ms:
        for model in args.models:
            for n, k in unique_shapes(model):
                if deadline_passed(args):
                    print("BENCH deadline reached", flush=True)
                    return
                if (m, n, k) in done:
                    continue
                done.add((m, n, k))
                key = jax.random.PRNGKey(m * 31 + n * 7 + k)
                row = dict(model=model, m=m, n=n, k=k, fmt="nvfp4")
                try:
                    cfg = autotune.get_config("fwd", m, n, k)
                    row["cfg"] = cfg.to_dict()
                    groups, items = packed_groups(key, m, n, k, "nvfp4")
                    t = time_ops(fwd_op("nvfp4", None, decode), groups)
                    row["ours_us"] = t["s"] * 1e6
                    row["compile_s"] = t["compile_s"]
                    deq = lambda x, c, s, g: dot_nt(x, P.dequantize(P.PackedWeight(c, s, g, "nvfp4"), jnp.bfloat16))
                    row["xla_dequant_us"] = time_ops(deq, groups)["s"] * 1e6
                    pb = packed_bytes(items[0])
                    row["packed_MB"] = pb / 1e6
                    row["ours_GBps"] = (pb + 2 * m * (k + n)) / (row["ours_us"] * 1e-6) / 1e9
                    if copy_bw:
                        row["pct_copy_bw"] = 100 * row["ours_GBps"] / copy_bw
                    if read_bw:
                        row["pct_read_bw"] = 100 * row["ours_GBps"] / read_bw
                    # bf16 weights: the dequantized values, rotated the same way
                    bgroups = bf16_copy_groups(items[0], [g_[0] for g_ in groups[0]])
                    del items, groups
                    row["bf16_us"] = time_ops(dot_nt, bgroups)["s"] * 1e6
                    row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
                    row["speedup_vs_xla_dequant"] = row["xla_dequant_us"] / row["ours_us"]
                    row["bf16_TFLOPs"] = 2 * m * n * k / (row["bf16_us"] * 1e-6) / 1e12
                    row["ours_TFLOPs"] = 2 * m * n * k / (row["ours_us"] * 1e-6) / 1e12
                    del bgroups
                except Exception as e:  # noqa: BLE001
                    log_error(f"bench {model} {m}x{n}x{k}", e)
                RESULTS["bench"].append(row)
                print("BENCH", json.dumps(row), flush=True)
                save(args)


def bench_bwd(args, decode: str, ms: list[int]):
    """Backward dx = dy @ W."""
    for m in ms:
        for model in args.models:
            for n, k in unique_shapes(model):
                if deadline_passed(args):
                    print("BWD deadline reached", flush=True)
                    return
                key = jax.random.PRNGKey(m * 17 + n * 3 + k)
                row = dict(model=model, m=m, n=n, k=k, fmt="nvfp4")
                try:
                    row["cfg"] = autotune.get_config("bwd", m, n, k).to_dict()
                    groups, items = packed_groups(key, m, n, k, "nvfp4", u_cap=8)
                    groups = [
                        [(rand_x(jax.random.fold_in(key, 5 + j), m, n),) + a[1:] for j, a in enumerate(g)]
                        for g in groups
                    ]
                    ours = lambda d, c, s, g: backward_launch(d, c, s, g, fmt=REGISTRY["nvfp4"], interpret=INTERPRET, decode=decode)
                    row["ours_us"] = time_ops(ours, groups)["s"] * 1e6
                    deq = lambda d, c, s, g: jax.lax.dot_general(
                        d,
                        P.dequantize(P.PackedWeight(c, s, g, "nvfp4"), jnp.bfloat16),
                        (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32,
                    ).astype(jnp.bfloat16)
                    row["xla_dequant_us"] = time_ops(deq, groups)["s"] * 1e6
                    bgroups = bf16_copy_groups(items[0], [a[0] for a in groups[0]], u_cap=4)
                    del items, groups
                    bf = lambda d, w: jax.lax.dot_general(
                        d, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
                    ).astype(jnp.bfloat16)
                    row["bf16_us"] = time_ops(bf, bgroups)["s"] * 1e6
                    row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
                    del bgroups
                except Exception as e:  # noqa: BLE001
                    log_error(f"bwd {model} {m}x{n}x{k}", e)
                RESULTS["bwd"].append(row)
                print("BWD", json.dumps(row), flush=True)
                save(args)


def section_bench(args, decode: str):
    """Forward at the target Ms first, then the backward, then the remaining Ms."""
    first = [m for m in (1, 16, 64, 4096) if m in args.ms]
    bench_fwd(args, decode, first)
    bench_bwd(args, decode, [m for m in args.bwd_ms if m in (16, 4096)])
    bench_fwd(args, decode, [m for m in args.ms if m not in first])
    bench_bwd(args, decode, [m for m in args.bwd_ms if m not in (16, 4096)])


def print_tables():
    print("\n=== forward (nvfp4), us; speedup = bf16 / ours ===")
    print(
        f"{'model':5} {'M':>5} {'N':>6} {'K':>6} {'ours':>9} {'bf16':>9} {'xla_deq':>9} {'x_bf16':>6} {'x_deq':>6} {'GB/s':>6} {'%copy':>5}"
    )
    for r in sorted(RESULTS["bench"], key=lambda r: (r["model"], r["m"], r["n"], r["k"])):
        if "ours_us" not in r or "bf16_us" not in r:
            print(f"{r['model']:5} {r['m']:>5} {r['n']:>6} {r['k']:>6}  failed")
            continue
        print(
            f"{r['model']:5} {r['m']:>5} {r['n']:>6} {r['k']:>6} {r['ours_us']:9.1f} {r['bf16_us']:9.1f} "
            f"{r['xla_dequant_us']:9.1f} {r['speedup_vs_bf16']:6.2f} {r['speedup_vs_xla_dequant']:6.2f} "
            f"{r['ours_GBps']:6.0f} {r.get('pct_copy_bw', 0):5.0f}"
        )
    if RESULTS["bwd"]:
        print("\n=== backward dx = dy @ W (nvfp4), us ===")
        for r in RESULTS["bwd"]:
            if "bf16_us" in r:
                print(
                    f"{r['model']:5} {r['m']:>5} {r['n']:>6} {r['k']:>6} ours {r['ours_us']:9.1f} "
                    f"bf16 {r['bf16_us']:9.1f} xla_deq {r['xla_dequant_us']:9.1f} x_bf16 {r['speedup_vs_bf16']:5.2f} {r['cfg'].get('mode')}"
                )
    print("\nenv:", json.dumps(RESULTS["env"]))
    print("errors:", len(RESULTS["errors"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--sections", default="env,check,sweep,bench")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds after start to stop starting work")
    ap.add_argument("--sweep-deadline", type=float, default=0.0, help="seconds after start to stop sweeping")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--bwd-ms", default="16,4096,256")
    ap.add_argument("--sweep-decode-ms", default="16,64")
    ap.add_argument("--sweep-prefill-ms", default="256")
    ap.add_argument("--sweep-decode-cands", default="", help="indices into SWEEP_DECODE, for every decode shape")
    ap.add_argument("--sweep-prefill-cands", default="", help="indices into SWEEP_PREFILL, for every shape")
    ap.add_argument("--sweep-size", default="small", choices=["small", "full"])
    ap.add_argument("--check-quick", action="store_true")
    ap.add_argument("--scale-words", action="store_true", help="force Config.scale_words=True (fused fwd kernels)")
    ap.add_argument("--decode", default="asm", choices=["asm", "jnp"])
    ap.add_argument(
        "--null-decode",
        action="store_true",
        help="diagnostic: the kernels use the code bytes converted to bf16 as W (wrong values, no nibble "
        "decode or scaling), to measure what the decode costs; never for results",
    )
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (tiny shapes)")
    args = ap.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    if INTERPRET:
        args.decode = "jnp"
    args.models = args.models.split(",")
    args.ms = [int(v) for v in args.ms.split(",")]
    args.bwd_ms = [int(v) for v in args.bwd_ms.split(",") if v]
    args.sweep_decode_ms = [int(v) for v in args.sweep_decode_ms.split(",") if v]
    args.sweep_prefill_ms = [int(v) for v in args.sweep_prefill_ms.split(",") if v]
    args.sweep_decode_cands = [int(v) for v in args.sweep_decode_cands.split(",") if v]
    args.sweep_prefill_cands = [int(v) for v in args.sweep_prefill_cands.split(",") if v]
    sections = args.sections.split(",")
    if args.scale_words:  # measure the pipelined scale loads everywhere the fused kernel runs
        base_get = autotune.get_config
        autotune.get_config = lambda kind, m, n, k: dataclasses.replace(base_get(kind, m, n, k), scale_words=True)
        SWEEP_DECODE[:] = [{"scale_words": True, **c} for c in SWEEP_DECODE]
    decode = args.decode
    if args.null_decode:
        from pallas_kernels import quant_matmul as qm_module

        def bytes_as_weights(codes, scales, fmt, decode, words=None):
            w = codes.astype(jnp.bfloat16)
            return jnp.stack([w, w], axis=-1).reshape(codes.shape[0], 2 * codes.shape[1])

        qm_module._decode_tile = bytes_as_weights
        sections = [s_ for s_ in sections if s_ != "check"]  # the values are wrong on purpose
    RESULTS["args"] = vars(args)
    if "env" in sections:
        section_env(args)
    if "check" in sections:
        if not section_check(args, decode) and decode == "asm":
            print("CHECK failed with the PTX decode; checking the jnp decode", flush=True)
            RESULTS["asm_check_failed"] = True
            if section_check(args, "jnp"):
                decode = "jnp"
    RESULTS["decode_used"] = decode
    save(args)
    if "sweep" in sections:
        section_sweep(args, decode)
    if "bench" in sections:
        section_bench(args, decode)
    RESULTS["elapsed_s"] = time.time() - T_START
    save(args)
    print_tables()


if __name__ == "__main__":
    main()
