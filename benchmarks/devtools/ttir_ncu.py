"""Profile the Pallas decode kernel outside JAX (Nsight Compute crashes when attached to a JAX
process on the device): `dump` lowers kernels to Triton IR with JAX, `run` compiles that IR
with the `triton` package and launches it from PyTorch, timing it with CUDA events against a
torch bf16 matmul of the same shape.

    python -m benchmarks.devtools.ttir_ncu dump --dir /tmp/ttir
    python -m benchmarks.devtools.ttir_ncu run --dir /tmp/ttir                       # timing
    ncu --profile-from-start off --set full -o X python -m benchmarks.devtools.ttir_ncu run --dir /tmp/ttir --profile

Diagnostic only (a kernel's values are not checked here; kernels.py checks them).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os

COPIES = 4  # 4 x 34 MB of codes > the 50 MB L2
CASES = {  # name: (M, N, K, config overrides on the autotune table's entry, null decode)
    "gate16": (16, 18944, 3584, {}, False),
    "gate16_fused": (16, 18944, 3584, {"mode": "fused", "bk": 128, "num_stages": 8, "scale_words": True}, False),
    "gate16_null": (16, 18944, 3584, {"mode": "fused", "bk": 128, "num_stages": 8, "scale_words": True}, True),
    "gate1": (1, 18944, 3584, {}, False),
    "down16": (16, 3584, 18944, {}, False),
}


def dump(out_dir: str):
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    from pallas_kernels import autotune

    qm = importlib.import_module("pallas_kernels.quant_matmul")
    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        r = orig(*a, **kw)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture
    if jax.default_backend() == "cpu" and hasattr(reg, "gpu_info_lib"):  # local dumps: pretend sm_90
        import types

        reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    real_decode = qm._decode_tile

    def null_decode(codes, scales, fmt, decode, words=None):
        w = codes.astype(jnp.bfloat16)
        return jnp.stack([w, w], axis=-1).reshape(codes.shape[0], 2 * codes.shape[1])

    os.makedirs(out_dir, exist_ok=True)
    manifest = {}
    for name, (m, n, k, over, null) in CASES.items():
        cfg0 = autotune.get_config("fwd", m, n, k)
        cfg, k_chunk = qm._fwd_config(m, n, k, "nvfp4", dataclasses.replace(cfg0, **over))
        qm._decode_tile = null_decode if null else real_decode
        sds = [
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), jnp.float32),
        ]
        f = jax.jit(lambda x, c, s, g, cfg=cfg: qm.forward_launch(x, c, s, g, fmt="nvfp4", interpret=False, cfg=cfg))
        captured.clear()
        f.trace(*sds).lower(lowering_platforms=("cuda",))
        qm._decode_tile = real_decode
        with open(os.path.join(out_dir, name + ".ttir"), "w") as fh:
            fh.write(captured[-1])
        tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
        manifest[name] = dict(
            m=m,
            n=n,
            k=k,
            cfg=cfg.to_dict(),
            grid=[-(-n // cfg.bn) if cfg.mode == "block" else tiles, cfg.split_k, 1],
            words=cfg.scale_words,
            null=null,
            table=[int(v) for v in qm._table_input("nvfp4")],
        )
        print(name, cfg, flush=True)
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)


def run(in_dir: str, profile: bool, names: list[str] | None):
    import torch
    import triton

    with open(os.path.join(in_dir, "manifest.json")) as fh:
        manifest = json.load(fh)
    dev = "cuda"
    results = {}
    for name, e in manifest.items():
        if names and name not in names:
            continue
        m, n, k, cfg = e["m"], e["n"], e["k"], e["cfg"]
        kern = triton.compile(
            os.path.join(in_dir, name + ".ttir"),
            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        )
        codes = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev) for _ in range(COPIES)]
        scales = [torch.randint(0x08, 0x70, (n, k // 16), dtype=torch.uint8, device=dev) for _ in range(COPIES)]
        if e["words"]:
            scales = [s.view(torch.int32) for s in scales]
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        g = torch.full((1,), 448.0 * 6, device=dev)
        r0 = torch.zeros(1, dtype=torch.int32, device=dev)
        table = torch.tensor(e["table"], dtype=torch.int32, device=dev)
        split = cfg["split_k"]
        out = torch.empty(
            (split * m, n) if split > 1 else (m, n), device=dev, dtype=torch.float32 if split > 1 else torch.bfloat16
        )
        grid = tuple(e["grid"])

        if cfg["mode"] == "block":  # (x, codes [N, K/16, 8], scale bytes, g, r0, out)
            codes = [c.view(n, k // 16, 8) for c in codes]
            scales = [s.view(torch.uint8) for s in scales]

            def launch(i, grid=grid, kern=kern, codes=codes, scales=scales, x=x, g=g, r0=r0, out=out):
                kern[grid](x, codes[i % COPIES], scales[i % COPIES], g, r0, out)
        else:

            def launch(i, grid=grid, kern=kern, codes=codes, scales=scales, x=x, g=g, r0=r0, table=table, out=out):
                kern[grid](x, codes[i % COPIES], scales[i % COPIES], g, r0, table, out)

        ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(2)]
        bf = lambda i, ws=ws, x=x: torch.matmul(x, ws[i % 2].T)  # noqa: E731
        for i in range(8):
            launch(i)
            bf(i)
        torch.cuda.synchronize()
        if profile:
            torch.cuda.profiler.start()
            launch(0)
            bf(0)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        res = {}
        for label, fn in (("ours", launch), ("bf16", bf)):
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for i in range(40):
                    fn(i)
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 40 * 1e3)
            res[label + "_us"] = sorted(ts)[2]
        res["codes_GBps"] = n * k // 2 / res["ours_us"] / 1e3
        res["ratio_bf16_over_ours"] = res["bf16_us"] / res["ours_us"]
        results[name] = res
        print(name, json.dumps(res), flush=True)
    if not profile:
        with open(os.path.join(in_dir, "timing.json"), "w") as fh:
            json.dump(results, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["dump", "run"])
    ap.add_argument("--dir", default="/tmp/ttir")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--names", default="")
    a = ap.parse_args()
    if a.mode == "dump":
        dump(a.dir)
    else:
        run(a.dir, a.profile, [s for s in a.names.split(",") if s])


if __name__ == "__main__":
    main()
