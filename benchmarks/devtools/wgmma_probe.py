"""Check and time the Mosaic GPU wgmma NVFP4 decode kernel (pallas_kernels/wgmma_nvfp4.py).

    python -m benchmarks.devtools.wgmma_probe --out $OUT/wgmma.json

check: kernel vs float32 reference (random weights, plus E4M3-subnormal and zero block scales),
with one CTA per SM and with 7 CTAs (uneven stream-K ranges, dummy steps);
bench: per Qwen2.5-7B / 32B shape (with --fused, also the q/k/v and gate/up weights stacked into
one, as the rollout runs them) and M, the library's config (`kernel_config`) and the other K
step, side by side with XLA bf16 `jnp.dot` and the Triton kernel (table config), same rotation
of weight copies as benchmarks/kernels.py. With --ctas-sweep N, also N smaller CTA counts whose
stream-K ranges align with the row groups (less partial-sum traffic, fewer SMs streaming); the
JSON has each count's partial-sum MB (`wgmma_nvfp4.partial_bytes`).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import kernels as kb
from pallas_kernels import wgmma_nvfp4 as wn  # noqa: E402

RES: dict = {"check": [], "bench": [], "errors": []}
T0 = time.time()


def save(path):
    with open(path, "w") as f:
        json.dump(RES, f, indent=1, default=str)


def err(where, e):
    msg = f"{where}: {type(e).__name__}: {e}"
    print("ERROR", msg[:1500], flush=True)
    RES["errors"].append({"where": where, "error": msg[:3000], "trace": traceback.format_exc()[-3000:]})


def wg_op(tk, stages, wgs, ctas=0):
    return lambda x, w, s, g: wn.wgmma_matmul(x, w, s, g, tk=tk, stages=stages, wgs=wgs, ctas=ctas)


def check(args):
    cases = [  # n, k, m, tk, wgs
        (128, 256, 1, 64, 1),
        (128, 256, 16, 128, 2),
        (192, 1024, 3, 256, 1),
        (512, 3584, 64, 128, 2),
        (3584, 3584, 16, 128, 2),
        (128, 512, 8, 64, 1),
        (128, 512, 40, 64, 2),
        (18944, 3584, 16, 256, 2),
    ]
    for n, k, m, tk, wgs in cases[: args.check_cases]:
        row = dict(n=n, k=k, m=m, tk=tk, wgs=wgs)
        try:
            key = jax.random.PRNGKey(n + k + m)
            p = kb.rand_packed(key, n, k, "nvfp4")
            if n == 128 and k == 512:  # E4M3 subnormal scales and an all-zero-scale row
                sc = p.scales.astype(jnp.float32).at[0, :].set(2.0**-8).at[1, :].set(0.0).at[2, :].set(2.0**-9)
                p = kb.P.PackedWeight(p.codes, sc.astype(jnp.float8_e4m3fn), p.global_scale, "nvfp4")
            x = kb.rand_x(jax.random.fold_in(key, 1), m, k)
            words, swords = wn.repack(p.codes, p.scales)
            ref = kb.ref_fwd(x, p)
            for ctas in (0, 7):
                y = wg_op(tk, 3, wgs, ctas)(x, words, swords, p.global_scale)
                row[f"rel_err_ctas{ctas}"] = kb.rel_err(y, ref)
        except Exception as e:  # noqa: BLE001
            err(f"check {n}x{k} m={m}", e)
            row["error"] = True
        RES["check"].append(row)
        print("CHECK", json.dumps(row), flush=True)
        save(args.out)


def wg_groups(key, m, n, k):
    groups, items = kb.packed_groups(key, m, n, k, "nvfp4")
    rep = {}
    out = []
    for g in groups:
        gg = []
        for x, c, s, gs in g:
            if id(c) not in rep:
                rep[id(c)] = wn.repack(c, s)
            w, sw = rep[id(c)]
            gg.append((x, w, sw, gs))
        out.append(gg)
    return groups, out, items


def fused_shapes(model: str) -> list[tuple[int, int]]:
    """[N, K] of the model's q/k/v and gate/up projections stacked along N (one call each)."""
    lin = {name: (n, k) for name, n, k in kb.model_linears(model)}
    return [(sum(lin[p][0] for p in group), lin[group[0]][1]) for group in (("q", "k", "v"), ("gate", "up"))]


def bench(args):
    """Per shape and M: the library config and the other K step vs Triton vs the bf16 dot."""
    for model in args.models.split(","):
        for n, k in kb.unique_shapes(model) + (fused_shapes(model) if args.fused else []):
            for m in [int(v) for v in args.ms.split(",")]:
                if time.time() - T0 > args.deadline:
                    print("deadline", flush=True)
                    return
                cfg = wn.kernel_config(m, n, k)
                row = dict(model=model, n=n, k=k, m=m, **cfg)
                try:
                    key = jax.random.PRNGKey(m * 31 + n * 7 + k)
                    tgroups, wgroups, items = wg_groups(key, m, n, k)
                    row["wgmma_us"] = kb.time_ops(wg_op(**cfg), wgroups)["s"] * 1e6
                    alt = 384 - cfg["tk"] if cfg["tk"] in (128, 256) else None  # the other K step
                    if alt and k % alt == 0:
                        stages = wn.fit_stages(wn.tile_rows(m), alt, cfg["wgs"], 6)
                        row[f"wgmma_tk{alt}_us"] = kb.time_ops(wg_op(alt, stages, cfg["wgs"]), wgroups)["s"] * 1e6
                    sms = wn.num_sms()
                    row["partial_MB"] = {sms: wn.partial_bytes(m, n, k, cfg["tk"], cfg["wgs"], sms) / 1e6}
                    if args.ctas_sweep:  # fewer CTAs, ranges aligned to row groups: less split-K traffic
                        for c in wn.aligned_ctas(n, k, cfg["tk"], cfg["wgs"], sms - 1)[-args.ctas_sweep :]:
                            row[f"wgmma_ctas{c}_us"] = kb.time_ops(wg_op(**cfg, ctas=c), wgroups)["s"] * 1e6
                            row["partial_MB"][c] = wn.partial_bytes(m, n, k, cfg["tk"], cfg["wgs"], c) / 1e6
                    row["triton_us"] = kb.time_ops(kb.fwd_op("nvfp4", None, "asm"), tgroups)["s"] * 1e6
                    bgroups = kb.bf16_copy_groups(items[0], [g_[0] for g_ in tgroups[0]])
                    row["bf16_us"] = kb.time_ops(kb.dot_nt, bgroups)["s"] * 1e6
                    row["bf16_over_wgmma"] = row["bf16_us"] / row["wgmma_us"]
                    row["bf16_over_triton"] = row["bf16_us"] / row["triton_us"]
                    row["wgmma_GBps"] = kb.packed_bytes(items[0]) / (row["wgmma_us"] * 1e-6) / 1e9
                    del bgroups, tgroups, wgroups, items
                except Exception as e:  # noqa: BLE001
                    err(f"bench {model} {n}x{k} m={m}", e)
                RES["bench"].append(row)
                print("BENCH", json.dumps(row), flush=True)
                save(args.out)


def table():
    print(
        f"{'model':5} {'N':>6} {'K':>6} {'M':>3} {'cfg':>8} {'bf16':>8} {'triton':>8} {'wgmma':>8} {'alt tk':>8} "
        f"{'bf16/tri':>8} {'bf16/wg':>8} {'GB/s':>6}"
    )
    for r in RES["bench"]:
        if "wgmma_us" not in r or "bf16_us" not in r:
            continue
        cfg = f"{r['tk']},{r['stages']},{r['wgs']}"
        alt = next((v for key, v in r.items() if key.startswith("wgmma_tk")), float("nan"))
        swept = {int(key[10:-3]): v for key, v in r.items() if key.startswith("wgmma_ctas")}
        best = min(swept, key=swept.get) if swept else None
        print(
            f"{r['model']:5} {r['n']:6} {r['k']:6} {r['m']:3} {cfg:>8} {r['bf16_us']:8.1f} {r['triton_us']:8.1f} "
            f"{r['wgmma_us']:8.1f} {alt:8.1f} {r['bf16_over_triton']:8.2f} {r['bf16_over_wgmma']:8.2f} "
            f"{r['wgmma_GBps']:6.0f}"
            + (f"   ctas {best}: {swept[best]:.1f} us ({r['wgmma_us'] / swept[best]:.2f}x)" if best else "")
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/wgmma.json")
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--deadline", type=float, default=400)
    ap.add_argument("--sections", default="check,bench")
    ap.add_argument("--check-cases", type=int, default=99)
    ap.add_argument("--fused", action="store_true", help="also the stacked q/k/v and gate/up shapes")
    ap.add_argument(
        "--ctas-sweep",
        type=int,
        default=0,
        help="also time this many of the largest aligned CTA counts below one per SM (wgmma_nvfp4.aligned_ctas)",
    )
    args = ap.parse_args()
    RES["env"] = dict(jax=jax.__version__, device=str(jax.devices()[0]))
    print(RES["env"], flush=True)
    if "check" in args.sections:
        check(args)
    if "bench" in args.sections:
        bench(args)
    save(args.out)
    table()


if __name__ == "__main__":
    main()
