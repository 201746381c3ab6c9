"""Where the train step's GPU time goes: kernels by kind and by name stack, from a JAX profile.

    python -m benchmarks.devtools.train_profile --out $OUT/train_profile.json   # GPU, 7B
    python -m benchmarks.devtools.train_profile --tiny --out /tmp/tp.json      # CPU smoke

The GRPO step's train phase at benchmarks/grpo_step.py's shape (Qwen2.5-7B shapes, random
weights, LoRA rank 16 on every projection, 64 sequences x (256 + 512) tokens, DAPO loss,
micro-batch 8; --remat and --attention as the train step takes them), one base format per
process, with XLA's command buffers off (so each kernel names its HLO instruction). The batch is
packed (`rl.packing`, as the training loop does); after compiling the micro-step and the update and
two timed steps, one step runs under `jax.profiler.trace`. Every GPU kernel of the trace is attributed to
the HLO instruction that launched it (the trace's `hlo_op` argument, or the kernel name) and,
through the compiled module's metadata, to the JAX name stack that made it (`op_name`: the model
marks attention, norms, RoPE, LoRA, base matmuls, the LM head and the loss with `jax.named_scope`). Reported: GPU busy time vs step time (host gaps), time by kind (dots, Pallas/Triton
kernels, attention, LM head, LoRA, optimizer, ...) and by name stack, with FLOPs counted by
formula (`benchmarks/common.py` train_flops) and achieved TFLOP/s against a bf16 matmul measured in
the same process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.devtools.decode_profile import gpu_kernels_with_args

# (kind, regex on "op_name kernel"); the model marks its parts with jax.named_scope. First match wins.
KINDS = (
    ("optimizer", r"/optimizer/"),
    ("lm_head+logprobs", r"lm_head_logprobs"),
    ("loss", r"/loss/"),
    ("lora", r"/lora/"),
    ("attention", r"/attention/"),
    ("rms_norm", r"/rms_norm/"),
    ("rope", r"/rope/"),
    ("dequant kernel", r"dequant"),
    ("w4a16 kernel", r"quant_matmul|_qmm|nvfp4"),
    ("base matmul", r"/base_matmul/"),
)


def hlo_metadata(hlo_text: str) -> dict[str, str]:
    """instruction name (and its kernel-name spelling, '.' -> '_') -> its op_name (JAX's name stack)."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", hlo_text, re.MULTILINE):
        name, meta = m.group(1), m.group(2)
        op = re.search(r'op_name="([^"]*)"', meta)
        desc = op.group(1) if op else "?"
        out[name] = desc
        out[name.replace(".", "_").replace("-", "_")] = desc
    return out


def kind_of(text: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, text, re.IGNORECASE):
            return kind
    if re.search(r"gemm|cutlass|nvjet|xmma|cublas", text, re.IGNORECASE):
        return "other dot"
    return "other"


def worker(args, fmt: str) -> dict:
    import jax
    import numpy as np

    from benchmarks import common
    from benchmarks.train_step import bf16_matmul_tflops
    from qerl_jax.lora import LoraConfig, init_lora, lora_scale
    from qerl_jax.optim import make_optimizer
    from qerl_jax.rl import packing
    from qerl_jax.rl import step as rl_step
    from qerl_jax.rl.losses import LossConfig

    config = common.model_config(args.model)
    params = common.random_params(config, quant=fmt, seed=0)
    frozen = {"base": params["base"], "norms": params["norms"]}
    lcfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=1000)
    seq = args.prompt_len + args.new_tokens
    batch = common.random_rl_batch(config, batch=args.batch, seq_len=seq, prompt_len=args.prompt_len)
    packed = rl_step.train_arrays(packing.pack_batch(batch, seq, rows_multiple=args.micro_batch_size))
    backend = "pallas" if fmt != "bf16" and jax.default_backend() == "gpu" else "xla"
    state = rl_step.init_train_state(init_lora(jax.random.key(1), config, lcfg), optimizer)
    step = rl_step.TrainStep(
        config,
        LossConfig(kind="dapo", eps_low=0.2, eps_high=0.28),
        optimizer,
        lora_scale=lora_scale(lcfg),
        backend=backend,
        remat=args.remat,
        attention=args.attention,
        micro_batch_size=args.micro_batch_size,
        logprob_chunk=args.logprob_chunk,
    )
    t0 = time.perf_counter()
    micro_args, update_args = step.lower_args(state, frozen, packed)
    programs = [step.micro.lower(*micro_args).compile(), step.update.lower(*update_args).compile()]
    compile_s = time.perf_counter() - t0
    # The step's calls reuse these programs; where an instruction name is in both, the micro-step's
    # (run once per micro-batch) names it.
    meta = {**hlo_metadata(programs[1].as_text()), **hlo_metadata(programs[0].as_text())}
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = step(state, frozen, packed)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        t0 = time.perf_counter()
        state, metrics = step(state, frozen, packed)
        jax.block_until_ready((state, metrics))
        profiled_s = time.perf_counter() - t0
    kernels = gpu_kernels_with_args(d)
    by_kind: dict = collections.defaultdict(float)
    by_phase: dict = collections.defaultdict(float)  # backward: under a transpose( in the name stack
    by_line: dict = collections.defaultdict(lambda: [0.0, 0])
    by_name: dict = collections.defaultdict(lambda: [0.0, 0])
    unmatched = 0
    for name, _, dur, kargs in kernels:
        hlo_op = kargs.get("hlo_op") or kargs.get("long_name", "").split(" ")[0] or name
        desc = meta.get(hlo_op) or meta.get(name)
        if desc is None:
            unmatched += 1
            desc = "?"
        kind = kind_of(f"{desc} {name}")
        by_kind[kind] += dur
        by_phase["backward" if "transpose(" in desc else "forward/other"] += dur
        by_line[f"{kind:18} {desc[:150]}"][0] += dur
        by_line[f"{kind:18} {desc[:150]}"][1] += 1
        by_name[name[:120]][0] += dur
        by_name[name[:120]][1] += 1
    busy_us = sum(by_kind.values())
    tokens = args.batch * seq
    flops = common.train_flops(config, tokens=tokens, seq_len=seq, lora_rank=args.rank)
    peak = bf16_matmul_tflops() or float("nan")
    stats = jax.devices()[0].memory_stats() or {}
    sample_args = [k[3] for k in kernels[:3]]
    return dict(
        format=fmt,
        backend=backend,
        device=str(jax.devices()[0].device_kind),
        compile_s=round(compile_s, 1),
        step_s=step_s,
        step_times_s=times,
        profiled_step_s=profiled_s,
        gpu_busy_s=busy_us / 1e6,
        kernels=len(kernels),
        unmatched_kernels=unmatched,
        tokens=tokens,
        flops=flops,
        achieved_tflops=flops["step"] / step_s / 1e12,
        bf16_matmul_tflops=peak,
        peak_fraction=flops["step"] / step_s / 1e12 / peak,
        peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
        phases_s={k: v / 1e6 for k, v in by_phase.items()},
        kinds_s={k: v / 1e6 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        lines=[
            dict(line=k, s=v[0] / 1e6, calls=v[1]) for k, v in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:60]
        ],
        names=[
            dict(name=k, s=v[0] / 1e6, calls=v[1]) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
        ],
        sample_kernel_args=sample_args,
        loss=float(np.asarray(metrics["loss"])),
    )


def table(results: list[dict]) -> None:
    for r in results:
        if "error" in r:
            print(f"\n{r['format']}: error {r['error'][-1500:]}")
            continue
        print(
            f"\n{r['format']:6} step {r['step_s']:.3f} s (profiled {r['profiled_step_s']:.3f}), GPU busy "
            f"{r['gpu_busy_s']:.3f} s, {r['kernels']} kernels ({r['unmatched_kernels']} unattributed); "
            f"{r['achieved_tflops']:.0f} TFLOP/s = {100 * r['peak_fraction']:.0f}% of the bf16 matmul's "
            f"{r['bf16_matmul_tflops']:.0f}; peak {r['peak_gib']:.1f} GiB; compile {r['compile_s']} s"
        )
        print("   " + "  ".join(f"{k} {v:.3f}" for k, v in r["kinds_s"].items()))
        print("   " + "  ".join(f"{k} {v:.3f}" for k, v in r["phases_s"].items()))
        for t in r["lines"][:25]:
            print(f"   {t['s']:7.3f} s {t['calls']:6d} x  {t['line'][:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/train_profile.json")
    ap.add_argument("--formats", default="bf16,nvfp4")
    ap.add_argument("--model", default="7B")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--logprob-chunk", type=int, default=256)
    ap.add_argument("--remat", default="full", help="full | proj | none")
    ap.add_argument("--attention", default="xla", help="xla | flash")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test: no GPU events)")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--timeout", type=float, default=280)
    args = ap.parse_args()
    if args.tiny:
        args.model, args.batch, args.prompt_len, args.new_tokens = "tiny", 4, 8, 8
        args.rank, args.micro_batch_size, args.logprob_chunk = 4, 2, 8
    if args.worker:
        try:
            res = worker(args, args.worker)
        except Exception as e:  # noqa: BLE001 (reported; the other formats still run)
            import traceback

            res = {"format": args.worker, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        print("RESULT " + json.dumps(res), flush=True)
        return
    results = []
    for fmt in args.formats.split(","):
        cmd = [sys.executable, "-m", __spec__.name, "--worker", fmt] + sys.argv[1:]
        # Without command buffers every kernel of the trace names its HLO instruction (inside a CUDA
        # graph they all name the graph), so the cuBLAS calls are attributed too.
        env = {
            **os.environ,
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip(),
        }
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"format": fmt, "error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            res = {"format": fmt, "error": f"timeout after {e.timeout} s"}
        results.append(res)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    table(results)


if __name__ == "__main__":
    main()
