"""Where a rollout decode step's GPU time goes: kernels by kind, per step, from a JAX profile.

    python -m benchmarks.devtools.decode_profile --out $OUT/decode_profile.json   # GPU
    python -m benchmarks.devtools.decode_profile --tiny --prompt-len 16 --cache-new-tokens 32  # CPU smoke

Qwen2.5 shapes (--model, default 7B) with random weights (benchmarks/rollout.py's model), LoRA
of --lora-rank on every projection (B = 0, as at the start of training; 0: none), one format per
process (--formats). For each batch, `generate` runs twice under `jax.profiler.trace`, with
--short and --long sampling steps (same compiled programs: the step count is a runtime
argument); the difference of the two traces, divided by the step difference, is one decode
step without the prefill. From the trace's GPU stream events (CUPTI) it reports, per step:
- the GPU busy time (kernel time: XLA runs one compute stream), the step time the same two calls take
  without the profiler (`wall_step_us`, each call's best of 3), and their difference, the time the GPU waits for work a
  step (`idle_us`: launches and host work not hidden behind kernels); and the step time measured under
  the profiler (which slows the host: compare busy times, not this one, across formats);
- kernel time by kind (the wgmma kernel, Triton kernels, dots (cuBLAS or XLA's GEMM fusions),
  XLA fusions, copies/other),
  and the heaviest kernels by name with their call counts.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

KINDS = (  # (kind, regex on the kernel name), first match wins
    ("wgmma", r"wgmma_nvfp4"),
    ("dot", r"gemv|gemm|cutlass|sm90_xmma|nvjet|cublas"),  # cuBLAS, or XLA's Triton GEMM fusions
    ("triton", r"triton|quant_matmul|nvfp4|mxfp4|nf4"),
    ("xla_fusion", r"fusion|loop_|input_|wrapped_|reduce|transpose|concatenate|scatter|gather|sort|select"),
    ("copy", r"memcpy|memset|copy|dynamic_update_slice"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def gpu_kernels_with_args(trace_dir: str) -> list[tuple[str, float, float, dict]]:
    """(name, start us, duration us, args) of every kernel on the GPU stream lines of the trace; args
    holds the profiler's annotations (e.g. "hlo_op", "hlo_module" on GPU)."""
    (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    gpu_lines = {key: name for key, name in threads.items() if "gpu" in procs.get(key[0], "").lower()}
    GPU_LINES.update(gpu_lines.values())
    # Stream lines hold the kernels; derived lines (XLA Ops / Modules, name scopes) repeat their time.
    keep = {key for key, name in gpu_lines.items() if "stream" in name.lower()}
    return [
        (e["name"], float(e["ts"]), float(e.get("dur", 0.0)), e.get("args", {}))
        for e in events
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keep
    ]


def gpu_kernels(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every kernel on the GPU stream lines of the trace."""
    return [k[:3] for k in gpu_kernels_with_args(trace_dir)]


GPU_LINES: set[str] = set()  # the GPU thread names seen (reported, to check the line filter)


def summarize(kernels: list[tuple[str, float, float]]) -> dict:
    """Kernel time and calls per kernel name in one trace."""
    names: dict = collections.defaultdict(lambda: [0.0, 0])
    for name, _, dur in kernels:
        names[name][0] += dur
        names[name][1] += 1
    return {n: tuple(v) for n, v in names.items()}


def per_step(short: dict, long: dict, steps: int) -> dict:
    """(long - short) / steps for every total: one decode step."""

    def diff(a, b):
        return (b - a) / steps

    names = {}
    for name, (t, c) in long.items():
        t0, c0 = short.get(name, (0.0, 0))
        names[name] = (diff(t0, t), diff(c0, c))
    kinds: dict = collections.defaultdict(float)  # from the names of the long trace: a one-off
    for name, (t, _) in names.items():  # event of the short one (e.g. an input copy) is left out
        kinds[kind_of(name)] += t
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:25]
    return dict(
        busy_us=sum(kinds.values()),
        kernels=sum(c for _, c in names.values()),
        kinds=dict(kinds),
        top=[dict(name=n[:160], us=t, calls=c) for n, (t, c) in top],
    )


def worker(args, fmt: str) -> dict:
    import jax
    import numpy as np

    import qerl_jax.rollout as rollout
    from benchmarks import rollout as bench
    from benchmarks.common import timed_generate
    from qerl_jax.models.qwen2 import ModelConfig

    config = ModelConfig(**bench.model_dict(args))
    params = bench.build_random_params(config, fmt, jax.random.key(0))
    params, lora_kw = bench.with_random_lora(params, config, args.lora_rank)
    backend = "xla" if fmt == "bf16" else "pallas"
    out = {"format": fmt, "backend": backend, "model": "tiny" if args.tiny else args.model,
           "lora_rank": args.lora_rank, "batches": []}  # fmt: skip
    rng = np.random.default_rng(0)
    for spec in args.batches.split(","):
        prompts, group = (int(v) for v in spec.split("x"))
        ids = rng.integers(0, config.vocab_size, (prompts, args.prompt_len), dtype=np.int32)
        mask = np.ones_like(ids)
        options = rollout.RolloutOptions(backend=backend, smaller_rows=())

        def run(steps, seed, options=options, ids=ids, mask=mask, group=group):
            """`steps` tokens per sequence at the cache size of --cache-new-tokens -> timings."""
            sampling = rollout.SamplingConfig(temperature=1.0, max_new_tokens=args.cache_new_tokens, ignore_eos=True)
            key = jax.random.key(seed)
            _, tm = timed_generate(
                config,
                params,
                ids,
                mask,
                key,
                sampling,
                group_size=group,
                max_new_tokens_per_seq=steps,
                options=options,
                **lora_kw,
            )
            return tm

        run(args.long, 1)  # compile
        run(args.long, 2)
        # best of 3 a length: one pair of wall times on a loaded host can even come out long < short
        unprofiled = {steps: min(run(steps, 3)["decode_s"] for _ in range(3)) for steps in (args.short, args.long)}
        traces = {}
        for steps in (args.short, args.long):
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d):
                tm = run(steps, 3)
            traces[steps] = (summarize(gpu_kernels(d)), tm)
        step = per_step(traces[args.short][0], traces[args.long][0], args.long - args.short)
        step["timed_step_us"] = (
            (traces[args.long][1]["decode_s"] - traces[args.short][1]["decode_s"]) / (args.long - args.short) * 1e6
        )
        step["wall_step_us"] = (unprofiled[args.long] - unprofiled[args.short]) / (args.long - args.short) * 1e6
        step["idle_us"] = step["wall_step_us"] - step["busy_us"]
        out["batches"].append(dict(batch=prompts * group, gpu_lines=sorted(GPU_LINES), **step))
        print(json.dumps(out["batches"][-1])[:3000], flush=True)
    return out


def table(results: list[dict]) -> None:
    for r in results:
        for b in r.get("batches", []):
            print(
                f"\n{r['format']:6} B={b['batch']:<4} step {b['wall_step_us']:8.1f} us: GPU busy {b['busy_us']:8.1f}, "
                f"idle {b['idle_us']:8.1f} (under the profiler {b['timed_step_us']:8.1f})  kernels/step {b['kernels']:6.1f}"
            )
            print("   " + "  ".join(f"{k} {v:7.1f}" for k, v in sorted(b["kinds"].items(), key=lambda kv: -kv[1])))
            for t in b["top"][:12]:
                print(f"   {t['us']:8.1f} us {t['calls']:6.1f} x  {t['name'][:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/decode_profile.json")
    ap.add_argument("--formats", default="bf16,nvfp4")
    ap.add_argument("--model", default="7B", help="Qwen2.5 size: 0.5B, 1.5B, 3B, 7B, 14B, 32B, 72B")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every projection (0: none)")
    ap.add_argument("--batches", default="1x1,2x8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cache-new-tokens", type=int, default=512)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=24)
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test: no GPU events)")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--timeout", type=float, default=250)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args, args.worker)), flush=True)
        return
    results = []
    for fmt in args.formats.split(","):
        t = time.time()
        cmd = [sys.executable, "-m", __spec__.name, "--worker", fmt] + sys.argv[1:]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"format": fmt, "error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            res = {"format": fmt, "error": f"timeout after {e.timeout} s"}
        res["wall_s"] = time.time() - t
        results.append(res)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        if "error" in res:
            print(fmt, res["error"][-1500:], flush=True)
    table(results)


if __name__ == "__main__":
    main()
