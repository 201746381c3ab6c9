"""Check and time the length-aware decode attention kernel (pallas_kernels/decode_attention.py).

    python -m benchmarks.devtools.decode_attention_probe --out $OUT/decode_attention.json [--quick]
    JAX_PLATFORMS=cpu python -m benchmarks.devtools.decode_attention_probe --interpret --tiny \
        --out /tmp/decode_attention.json                                     # CPU smoke test of this script

check: the compiled kernel (default tuning and forced splits) against `qwen2.decode_attention_reference`
on float32 copies of the inputs, on fresh random inputs of several shapes (GQA 7 / 5 / 3 / 1,
D 128 / 64, bf16 / f32, ragged rows with left padding, a row at the cache end, a row of length 1,
an inactive row); then NaN in every slot outside [start, end) must leave the output unchanged
(the kernel never reads them).

bench: Qwen2.5-7B shapes (H 28, KVH 4, D 128, bf16 cache), B in {1, 16, 64, 256}, S in {768, 2304};
lengths "ragged" (prompts left-padded to 256 with lengths 100-256, decoded lengths log-normal with
median 300 clipped to the cache) and "full" (every row fills the cache). Side by side in one
process: the kernel (default tuning, `default_num_splits`), the XLA reference (masked softmax over
the whole cache) and the model's `qwen2.attention` on the full cache with the mask. GB/s: the
kernel's on the bytes a call must move (`decode_attention.bytes_moved`: the valid K/V slots once),
against ~3.0 TB/s on the H100; the XLA paths' on the whole cache they read.

sweep: for the small batches, num_splits x block_s (x num_stages without --quick) at each S on the
ragged lengths: the best configuration, and the default rule's choice with its time.

Timing: benchmarks/kernels.py's `time_ops` (each executable runs U calls on different cache copies,
rotated so that the copies in flight exceed the 50 MB L2; medians over batches). Every result so far
is written to --out after each step; work stops being started at --deadline seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels as kb
from qerl_jax.models import qwen2

# The module: the package's `decode_attention` attribute is the function of the same name.
da = importlib.import_module("pallas_kernels.decode_attention")

PEAK_GBPS = 3000.0  # H100 SXM HBM3, achievable read bandwidth (~3.35 TB/s nominal)
SHAPE_7B = dict(heads=28, kv_heads=4, head_dim=128)
RES: dict = {"env": {}, "check": [], "bench": [], "sweep": [], "errors": []}
T0 = time.time()


def save(path: str) -> None:
    with open(path, "w") as f:
        json.dump(RES, f, indent=1, default=str)


def err(where: str, e: BaseException) -> None:
    msg = f"{where}: {type(e).__name__}: {e}"
    print("ERROR", msg[:1500], flush=True)
    RES["errors"].append({"where": where, "error": msg[:3000], "trace": traceback.format_exc()[-3000:]})


def deadline(args) -> bool:
    if time.time() - T0 > args.deadline:
        print("deadline reached: no more work started", flush=True)
        return True
    return False


# ----------------------------------------------------------------------------- inputs


def row_lengths(rng: np.random.Generator, b: int, s: int, kind: str, prompt_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) int32 [B]. "ragged": prompts left-padded to prompt_pad with lengths in
    [100/256, 1] * prompt_pad, then log-normal decoded lengths (median 300/256 * prompt_pad)
    clipped to the cache; "full": [0, S) for every row."""
    if kind == "full":
        return np.zeros(b, np.int32), np.full(b, s, np.int32)
    prompt = rng.integers(round(prompt_pad * 100 / 256), prompt_pad + 1, b)
    median = 300 * prompt_pad / 256
    decoded = np.clip(np.round(rng.lognormal(np.log(median), 0.6, b)), 1, s - prompt_pad)
    return (prompt_pad - prompt).astype(np.int32), (prompt_pad + decoded).astype(np.int32)


def edge_lengths(b: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows with the edge cases first (needs B >= 5): full, left-padded to the end,
    length 1, inactive, a ragged interior range; the rest random."""
    rng = np.random.default_rng(b * 7919 + s)
    start = rng.integers(0, s // 2, b)
    end = np.minimum(start + rng.integers(1, s, b), s)
    fixed = [(0, s), (s // 3, s), (s // 2, s // 2 + 1), (s // 4, s // 4), (5, s - 7)]
    for i, (lo, hi) in enumerate(fixed[:b]):
        start[i], end[i] = lo, hi
    return start.astype(np.int32), end.astype(np.int32)


def rand_cache(key, b: int, s: int, kv_heads: int, d: int, dtype) -> tuple[jax.Array, jax.Array]:
    kk, kv = jax.random.split(key)
    return (jax.random.normal(kk, (b, s, kv_heads, d), jnp.float32).astype(dtype),
            jax.random.normal(kv, (b, s, kv_heads, d), jnp.float32).astype(dtype))  # fmt: skip


def cache_groups(key, q, start, end, s: int, kv_heads: int, copies: int):
    """Groups of (q, k, v, start, end) over `copies` different caches (kb.time_ops' argument)."""
    b, _, d = q.shape
    items = [
        (q, *rand_cache(jax.random.fold_in(key, i), b, s, kv_heads, d, q.dtype), start, end) for i in range(copies)
    ]
    return kb.make_groups(items, min(8, copies))


def num_copies(b: int, s: int, kv_heads: int, d: int, tiny: bool) -> int:
    return 2 if tiny else kb.n_copies(2 * b * s * kv_heads * d * 2)


# ----------------------------------------------------------------------------- ops


def kernel_op(interpret: bool, **tuning):
    return lambda q, k, v, start, end: da.decode_attention(q, k, v, start, end, interpret=interpret, **tuning)


def reference_op(q, k, v, start, end):
    return qwen2.decode_attention_reference(q, k, v, start, end)


def model_op(q, k, v, start, end):
    """The model's attention on the full cache with the [start, end) mask (T = 1)."""
    slots = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask_BxTxS = ((slots >= start[:, None]) & (slots < end[:, None]))[:, None, :]
    return qwen2.attention(q[:, None], k, v, mask_BxTxS)[:, 0]


def time_us(op, groups, interpret: bool) -> float:
    return kb.time_ops(op, groups, reps=1 if interpret else 5)["s"] * 1e6


# ----------------------------------------------------------------------------- sections


def check(args) -> None:
    cases = [  # b, s, kv_heads, g, d, dtype, tuning
        (1, 2304, 4, 7, 128, jnp.bfloat16, {}),
        (7, 768, 4, 7, 128, jnp.bfloat16, {}),
        (64, 2304, 4, 7, 128, jnp.bfloat16, {}),
        (6, 1000, 8, 5, 128, jnp.bfloat16, dict(num_splits=4)),
        (5, 300, 3, 3, 64, jnp.float32, {}),
        (9, 513, 2, 7, 64, jnp.bfloat16, dict(num_splits=3, block_s=32)),
        (5, 200, 2, 1, 128, jnp.bfloat16, dict(num_splits=1, block_s=128)),
    ]
    if args.tiny:
        cases = [(6, 50, 2, 7, 64, jnp.bfloat16, {}), (5, 40, 3, 3, 64, jnp.float32, dict(num_splits=3, block_s=16))]
    for b, s, kv_heads, g, d, dtype, tuning in cases:
        if deadline(args):
            return
        row = dict(b=b, s=s, kv_heads=kv_heads, g=g, d=d, dtype=jnp.dtype(dtype).name, tuning=tuning)
        try:
            key = jax.random.PRNGKey(int(time.time() * 1000) % 2**31)
            start, end = (jnp.asarray(x) for x in edge_lengths(b, s))
            q = jax.random.normal(jax.random.fold_in(key, 99), (b, kv_heads * g, d), jnp.float32).astype(dtype)
            k, v = rand_cache(key, b, s, kv_heads, d, dtype)
            row["num_splits"] = tuning.get("num_splits", da.default_num_splits(b, kv_heads, s))
            run = jax.jit(kernel_op(args.interpret, **tuning))
            out = run(q, k, v, start, end)
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            ref = qwen2.decode_attention_reference(*f32, start, end)
            row["rel_err_vs_f32_reference"] = kb.rel_err(out, ref)
            row["rel_err_reference_vs_f32"] = kb.rel_err(qwen2.decode_attention_reference(q, k, v, start, end), ref)
            inactive = np.asarray(end <= start)
            row["inactive_rows_zero"] = bool(np.all(np.asarray(out, np.float32)[inactive] == 0))
            slots = jnp.arange(s)
            outside = ((slots < start[:, None]) | (slots >= end[:, None]))[:, :, None, None]
            nan_k, nan_v = (jnp.where(outside, jnp.nan, x).astype(dtype) for x in (k, v))
            dirty = run(q, nan_k, nan_v, start, end)
            row["nan_outside_unchanged"] = bool(jnp.array_equal(dirty, out))
            tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
            row["ok"] = bool(
                row["rel_err_vs_f32_reference"] < tol and row["inactive_rows_zero"] and row["nan_outside_unchanged"]
            )
        except Exception as e:  # noqa: BLE001
            err(f"check {row}", e)
            row["ok"] = False
        RES["check"].append(row)
        print("CHECK", json.dumps(row, default=str), flush=True)
        save(args.out)


def bench(args) -> None:
    heads, kv_heads, d = SHAPE_7B["heads"], SHAPE_7B["kv_heads"], SHAPE_7B["head_dim"]
    for s in args.seqs:
        for b in args.batches:
            for kind in ("ragged", "full"):
                if deadline(args):
                    return
                row = dict(b=b, s=s, lengths=kind, num_splits=da.default_num_splits(b, kv_heads, s))
                try:
                    key = jax.random.PRNGKey(b * 100003 + s)
                    start, end = row_lengths(np.random.default_rng(b + s), b, s, kind, args.prompt_pad)
                    q = jax.random.normal(key, (b, heads, d), jnp.float32).astype(jnp.bfloat16)
                    k_sds = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.bfloat16)
                    row["valid_MB"] = da.bytes_moved(q, k_sds, start, end) / 1e6
                    row["cache_MB"] = da.bytes_moved(q, k_sds, np.zeros(b), np.full(b, s)) / 1e6
                    row["mean_len"] = float(np.mean(end - start))
                    groups = cache_groups(
                        key,
                        q,
                        jnp.asarray(start),
                        jnp.asarray(end),
                        s,
                        kv_heads,
                        num_copies(b, s, kv_heads, d, args.tiny),
                    )
                    row["kernel_us"] = time_us(kernel_op(args.interpret), groups, args.interpret)
                    row["reference_us"] = time_us(reference_op, groups, args.interpret)
                    try:
                        row["model_us"] = time_us(model_op, groups, args.interpret)
                    except Exception as e:  # noqa: BLE001  (e.g. qerl_jax's imports on the device)
                        err(f"bench model_op {b}x{s}", e)
                    row["kernel_GBps"] = row["valid_MB"] * 1e6 / (row["kernel_us"] * 1e-6) / 1e9
                    row["kernel_pct_peak"] = 100 * row["kernel_GBps"] / PEAK_GBPS
                    row["reference_GBps_cache"] = row["cache_MB"] * 1e6 / (row["reference_us"] * 1e-6) / 1e9
                    row["reference_over_kernel"] = row["reference_us"] / row["kernel_us"]
                    if "model_us" in row:
                        row["model_over_kernel"] = row["model_us"] / row["kernel_us"]
                    del groups
                except Exception as e:  # noqa: BLE001
                    err(f"bench {row}", e)
                RES["bench"].append(row)
                print("BENCH", json.dumps(row), flush=True)
                save(args.out)


def sweep(args) -> None:
    kv_heads, heads, d = SHAPE_7B["kv_heads"], SHAPE_7B["heads"], SHAPE_7B["head_dim"]
    cands = [
        dict(num_splits=ns, block_s=bs, num_stages=st)
        for ns in args.sweep_splits
        for bs in args.sweep_blocks
        for st in args.sweep_stages
    ]
    for s in args.seqs:
        for b in args.sweep_batches:
            if deadline(args):
                return
            row = dict(b=b, s=s, lengths="ragged", default_num_splits=da.default_num_splits(b, kv_heads, s), us={})
            try:
                key = jax.random.PRNGKey(b * 7 + s)
                start, end = row_lengths(np.random.default_rng(b + s), b, s, "ragged", args.prompt_pad)
                q = jax.random.normal(key, (b, heads, d), jnp.float32).astype(jnp.bfloat16)
                groups = cache_groups(
                    key, q, jnp.asarray(start), jnp.asarray(end), s, kv_heads, num_copies(b, s, kv_heads, d, args.tiny)
                )
                row["default_us"] = time_us(kernel_op(args.interpret), groups, args.interpret)
                for cand in cands:
                    if deadline(args):
                        break
                    name = ",".join(f"{k_}={v_}" for k_, v_ in cand.items())
                    try:
                        row["us"][name] = time_us(kernel_op(args.interpret, **cand), groups, args.interpret)
                    except Exception as e:  # noqa: BLE001
                        err(f"sweep {b}x{s} {name}", e)
                if row["us"]:
                    best = min(row["us"], key=row["us"].get)
                    row["best"], row["best_us"] = best, row["us"][best]
                    row["default_over_best"] = row["default_us"] / row["best_us"]
                del groups
            except Exception as e:  # noqa: BLE001
                err(f"sweep {b}x{s}", e)
            RES["sweep"].append(row)
            print("SWEEP", json.dumps(row), flush=True)
            save(args.out)


def table() -> None:
    print(
        f"\n{'B':>4} {'S':>5} {'lengths':>7} {'mean len':>8} {'splits':>6} {'kernel us':>9} {'GB/s':>6} {'% peak':>6} "
        f"{'ref us':>8} {'model us':>8} {'ref/kern':>8} {'model/kern':>10}"
    )
    nan = float("nan")
    for r in RES["bench"]:
        if "kernel_us" not in r:
            continue
        print(
            f"{r['b']:4} {r['s']:5} {r['lengths']:>7} {r['mean_len']:8.0f} {r['num_splits']:6} {r['kernel_us']:9.1f} "
            f"{r['kernel_GBps']:6.0f} {r['kernel_pct_peak']:6.1f} {r['reference_us']:8.1f} "
            f"{r.get('model_us', nan):8.1f} {r['reference_over_kernel']:8.2f} {r.get('model_over_kernel', nan):10.2f}"
        )
    for r in RES["sweep"]:
        if "best" in r:
            print(
                f"sweep B={r['b']} S={r['s']}: best {r['best']} {r['best_us']:.1f} us; default (num_splits="
                f"{r['default_num_splits']}) {r['default_us']:.1f} us ({r['default_over_best']:.2f}x the best)"
            )
    bad = [r for r in RES["check"] if not r.get("ok")]
    print(f"check: {len(RES['check']) - len(bad)} / {len(RES['check'])} ok; errors: {len(RES['errors'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/decode_attention.json")
    ap.add_argument("--sections", default="check,bench,sweep")
    ap.add_argument("--quick", action="store_true", help="S 2304 only, a small sweep (< 2 minutes on an H100)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test, with --interpret)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after start to stop starting work")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--seqs", default="768,2304")
    ap.add_argument("--sweep-batches", default="1,16")
    ap.add_argument("--sweep-splits", default="1,2,4,8,16,32")
    ap.add_argument("--sweep-blocks", default="32,64,128")
    ap.add_argument("--sweep-stages", default="2,3")
    args = ap.parse_args()
    args.prompt_pad = 256
    if args.quick:
        args.seqs, args.sweep_splits, args.sweep_blocks, args.sweep_stages = "2304", "1,4,16", "64,128", "2"
        args.deadline = min(args.deadline, 105.0)
    if args.tiny:
        args.batches, args.seqs, args.sweep_batches, args.prompt_pad = "1,6", "48", "1", 16
        args.sweep_splits, args.sweep_blocks, args.sweep_stages = "1,3", "16", "2"
    for name in ("batches", "seqs", "sweep_batches", "sweep_splits", "sweep_blocks", "sweep_stages"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",") if x])
    RES["args"] = vars(args)
    RES["env"] = dict(jax=jax.__version__, device=str(jax.devices()[0]), device_kind=jax.devices()[0].device_kind)
    print(RES["env"], flush=True)
    sections = args.sections.split(",")
    if "check" in sections:
        check(args)
    if "bench" in sections:
        bench(args)
    if "sweep" in sections:
        sweep(args)
    RES["elapsed_s"] = time.time() - T0
    save(args.out)
    table()


if __name__ == "__main__":
    main()
