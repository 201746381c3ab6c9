"""Train-step benchmark: the GRPO/DAPO LoRA train step on Qwen2.5-shaped random weights, side by side
with the transformers + PEFT peer (`benchmarks/common.py`).

    python -m benchmarks.train_step --out $OUT/train_step.json      # GPU: 7B, 64 x (256 + 512)
    python -m benchmarks.train_step --tiny --out /tmp/train_step.json  # CPU smoke test

The default shape is the GRPO step's train phase (`benchmarks/grpo_step.py`): Qwen2.5-7B, LoRA rank 16
on every projection, 64 sequences of 256 prompt + 512 response tokens, DAPO loss, micro-batches of
8, log-prob chunks of 256. Cases (`--cases`, comma-separated):

- `FORMAT:ATTENTION:REMAT`, FORMAT bf16 | nvfp4 | mxfp4 | nf4, ATTENTION xla | flash, REMAT full |
  proj | none | auto (what the training loop picks: `memory.fit(..., remat_fallback=True)` on this
  device). The default cases time the recipe's settings (flash, auto) and the previous ones (xla,
  full) for bf16 and NVFP4.
- `peer`: transformers + PEFT, bf16, gradient checkpointing, the same batch, loss and micro-batches.

Each case runs in its own process (its own peak memory): build, one warm-up step (it compiles the
packed micro-step and the update: `rl.packing` rows of prompt + response slots, as the training
loop packs them), then the median of --steps timed steps. Reported: step time, tokens/s, TFLOP/s by the FLOP formula of
`common.train_flops` (printed), that as a fraction of a bf16 8192^3 matmul timed in the same process
(16 chained products, best of 5: the measured peak, not the datasheet's), the device's peak memory, compile time. Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

from benchmarks import with_repo_on_path

RESULT_PREFIX = "RESULT "
DEFAULT_CASES = "nvfp4:flash:auto,bf16:flash:auto,nvfp4:xla:full,bf16:xla:full,peer"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test)")
    p.add_argument("--model", default="7B", help="Qwen2.5 size (0.5B ... 72B)")
    p.add_argument("--cases", default=DEFAULT_CASES, help="FORMAT:ATTENTION:REMAT or peer, comma-separated")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512, help="response tokens (sequence = prompt + response)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per case (child process)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.model, args.batch, args.prompt_len, args.new_tokens = "tiny", 4, 16, 48
        args.micro_batch_size, args.logprob_chunk, args.rank = 2, 16, 4
    return args


def bf16_matmul_tflops(n: int = 8192, chain: int = 16, reps: int = 5) -> float | None:
    """A bf16 n^3 matmul's rate on the first device, or None off GPU: `chain` dependent products in
    one program (no per-product dispatch in the timing), best of `reps` runs."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        return None
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
    f = jax.jit(lambda x, y: jax.lax.fori_loop(0, chain, lambda _, z: z @ y, x))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * chain / best / 1e12


def _mem_stats() -> dict[str, int] | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 (some backends do not implement it)
        return None
    return stats or None


def _common(args, config) -> dict[str, Any]:
    from benchmarks import common

    tokens = args.batch * (args.prompt_len + args.new_tokens)
    flops = common.train_flops(config, tokens=tokens, seq_len=args.prompt_len + args.new_tokens, lora_rank=args.rank)
    return {"model": args.model, "tokens": tokens, "flops": flops, "lora_rank": args.rank, "batch": args.batch}


def _finish(row: dict[str, Any], peak_tflops: float | None) -> dict[str, Any]:
    if "step_s" in row:
        row["tokens_per_s"] = round(row["tokens"] / row["step_s"], 1)
        row["tflops"] = round(row["flops"]["step"] / row["step_s"] / 1e12, 1)
        row["bf16_matmul_tflops"] = None if peak_tflops is None else round(peak_tflops, 1)
        row["peak_fraction"] = None if peak_tflops is None else round(row["tflops"] / peak_tflops, 3)
    return row


def resolve_remat(config, *, fmt: str, backend: str, attention: str, remat: str, args) -> tuple[str, int]:
    """(remat mode, micro-batch) as the training loop picks them: "auto" is `memory.fit` with the
    remat fallback on this device ("full" where the device reports no memory size)."""
    from qerl_jax import memory

    if remat != "auto":
        return remat, args.micro_batch_size
    device_bytes = memory.device_memory_bytes()
    if device_bytes is None:
        return "full", args.micro_batch_size
    inputs = memory.PlanInputs(
        quant=fmt,
        lora_rank=args.rank,
        rollout_batch=args.batch if hasattr(args, "batch") else args.prompts * args.group,
        prompt_len=args.prompt_len,
        max_new_tokens=args.new_tokens,
        micro_batch_size=args.micro_batch_size,
        remat="proj",
        attention=attention,
        logprob_chunk=args.logprob_chunk,
        backend=backend,
    )
    fit = memory.fit(memory.plan_memory(config, inputs), device_bytes, remat_fallback=True)
    return fit.remat, fit.micro_batch_size


def run_jax_case(args, fmt: str, attention: str, remat: str) -> dict[str, Any]:
    import jax

    from benchmarks import common
    from qerl_jax.lora import LoraConfig, init_lora, lora_scale
    from qerl_jax.optim import make_optimizer
    from qerl_jax.rl import packing
    from qerl_jax.rl import step as rl_step
    from qerl_jax.rl.losses import LossConfig

    config = common.model_config(args.model)
    row = {"case": f"{fmt}:{attention}:{remat}", "format": fmt, "attention": attention, **_common(args, config)}
    backend = "pallas" if fmt != "bf16" and jax.default_backend() == "gpu" else "xla"
    seq = args.prompt_len + args.new_tokens
    remat, mb = resolve_remat(config, fmt=fmt, backend=backend, attention=attention, remat=remat, args=args)
    row.update(remat=remat, micro_batch_size=mb, backend=backend, device=str(jax.devices()[0].device_kind))
    t0 = time.perf_counter()
    params = common.random_params(config, quant=fmt, seed=0)
    frozen = {"base": params["base"], "norms": params["norms"]}
    row["build_s"] = round(time.perf_counter() - t0, 1)
    lcfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=1000)
    batch = common.random_rl_batch(config, batch=args.batch, seq_len=seq, prompt_len=args.prompt_len)
    packed = packing.pack_batch(batch, seq, rows_multiple=mb)
    row.update({f"train_tokens_{k}": v for k, v in packing.token_counts(packed).items()})
    state = rl_step.init_train_state(init_lora(jax.random.key(1), config, lcfg), optimizer)
    step = rl_step.TrainStep(
        config,
        LossConfig(kind="dapo", eps_low=0.2, eps_high=0.28),
        optimizer,
        lora_scale=lora_scale(lcfg),
        backend=backend,
        remat=remat,
        attention=attention,
        micro_batch_size=mb,
        logprob_chunk=args.logprob_chunk,
    )
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(secs) if name.endswith("backend_compile_duration") else None
    )
    times = []
    for i in range(args.steps + 1):  # the first step compiles the micro-step and the update: a warm-up
        t0 = time.perf_counter()
        state, metrics = step(state, frozen, packed)
        jax.block_until_ready((state, metrics))
        if i:
            times.append(time.perf_counter() - t0)
        else:
            row["compile_s"] = round(sum(compiles), 1)
    stats = _mem_stats() or {}
    row.update(
        step_s=statistics.median(times),
        step_times_s=[round(t, 4) for t in times],
        loss=float(metrics["loss"]),
        grad_norm=float(metrics["grad_norm"]),
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
    )
    del state, params, frozen
    return _finish(row, bf16_matmul_tflops())


def run_peer_case(args) -> dict[str, Any]:
    import torch
    import transformers

    from benchmarks import common

    config = common.model_config(args.model)
    row = {"case": "peer", "format": "bf16", "attention": "sdpa", "remat": "full", **_common(args, config)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row.update(
        micro_batch_size=args.micro_batch_size,
        backend=f"transformers {transformers.__version__} + peft, torch {torch.__version__}",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
    )
    t0 = time.perf_counter()
    model = common.peer_model(config, lora_rank=args.rank, device=device)
    row["build_s"] = round(time.perf_counter() - t0, 1)
    batch = common.random_rl_batch(
        config, batch=args.batch, seq_len=args.prompt_len + args.new_tokens, prompt_len=args.prompt_len
    )
    row.update(common.time_peer_train(model, batch, micro_batch_size=args.micro_batch_size, steps=args.steps))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return _finish(row, _torch_bf16_matmul_tflops() if device == "cuda" else None)


def _torch_bf16_matmul_tflops(n: int = 8192, chain: int = 16, reps: int = 5) -> float:
    """The same measurement as `bf16_matmul_tflops`, through torch (the peer's process)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, n, device="cuda") / n**0.5).to(torch.bfloat16)
    best = float("inf")
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        z = a
        for _ in range(chain):
            z = z @ b
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * chain / best / 1e12


def _child_env() -> dict[str, str]:
    env = with_repo_on_path(dict(os.environ))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the "proj" and "none" cases need more than 75%
    return env


def run_children(args) -> list[dict[str, Any]]:
    """Driver: one child process per case; collects their RESULT lines."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c != "peer" and len(c.split(":")) != 3:
            raise SystemExit(f"--cases entries are FORMAT:ATTENTION:REMAT or peer; got {c!r}")
    passthrough, skip_next = [], False
    for a in args.argv:  # the child gets the same flags, minus --out and --cases
        if skip_next:
            skip_next = False
        elif a in ("--out", "--cases"):
            skip_next = True
        elif not a.startswith(("--out=", "--cases=")):
            passthrough.append(a)
    results = []
    for case in cases:
        cmd = [sys.executable, "-m", __spec__.name, *passthrough, "--case", case]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=args.timeout)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = f"timed out after {args.timeout} s", None
        got = [json.loads(line[len(RESULT_PREFIX) :]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        row = got[-1] if got else {"case": case, "error": f"child exited with {rc}: {stderr[-1500:]}"}
        row["process_s"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        if args.out:  # after every case: a call cut short keeps what it measured
            _write(args, results, None)
        print(
            f"[{case}] {row.get('step_s', row.get('error', '?'))!s:.80} ({row['process_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    return results


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def table(results: list[dict[str, Any]], args) -> str:
    ok = [r for r in results if "step_s" in r]
    flops = ok[0]["flops"] if ok else None
    head = (
        f"{'case':20} {'remat':5} {'mb':>3} {'step s':>7} {'tok/s':>8} {'TFLOP/s':>8} {'of peak':>8} "
        f"{'vs peer':>8} {'peak GiB':>9} {'compile s':>9}"
    )
    peer_row = next((r for r in ok if r["case"] == "peer"), None)
    lines = [
        f"train step: {args.model}-shaped random model, LoRA r{args.rank} on every projection, {args.batch} sequences "
        f"x ({args.prompt_len} + {args.new_tokens}) tokens, DAPO, micro-batch {args.micro_batch_size}",
    ]
    if flops:
        lines.append(
            f"FLOPs by formula (benchmarks/common.py train_flops: 3 forward passes of 2*N*K per token per matrix + causal "
            f"attention + LoRA, + LoRA weight gradients): {flops['step'] / 1e12:.0f} TFLOP per step "
            f"(attention {100 * flops['attention_share']:.1f}% of a forward)"
        )
    lines += [head, "-" * len(head)]
    for r in results:
        if "step_s" not in r:
            lines.append(f"{r.get('case', '?'):20} error: {r.get('error', '')[:150]}")
            continue
        frac = "-" if r.get("peak_fraction") is None else f"{100 * r['peak_fraction']:.0f}%"
        vs = "-" if peer_row is None else f"{peer_row['step_s'] / r['step_s']:.2f}x"
        lines.append(
            f"{r['case']:20} {r['remat']:5} {r['micro_batch_size']:>3} {r['step_s']:7.3f} {r['tokens_per_s']:8.0f} "
            f"{r['tflops']:8.1f} {frac:>8} {vs:>8} {_gib(r.get('peak_bytes_in_use')):>9} {r.get('compile_s', '-')!s:>9}"
        )
    peaks = sorted({r["bf16_matmul_tflops"] for r in ok if r.get("bf16_matmul_tflops")})
    if peaks:
        lines.append(
            f"bf16 8192^3 matmul measured in each case's process: {', '.join(f'{p:.0f}' for p in peaks)} TFLOP/s"
        )
    return "\n".join(lines)


def _write(args, results: list[dict[str, Any]], wall_s: float | None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("case", "argv")}, "wall_s": wall_s}
    with open(args.out, "w") as f:
        json.dump({**summary, "results": results}, f, indent=2)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        try:
            if args.case == "peer":
                row = run_peer_case(args)
            else:
                row = run_jax_case(args, *args.case.split(":"))
        except Exception as e:  # noqa: BLE001 (an OOM case is a result, not a crash)
            msg = f"{type(e).__name__}: {e}"
            oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
            row = {
                "case": args.case,
                "error": ("OOM: " if oom else "") + msg[:2000],
                "trace": traceback.format_exc()[-3000:],
            }
        print(RESULT_PREFIX + json.dumps(row), flush=True)
        return
    t0 = time.perf_counter()
    results = run_children(args)
    print(table(results, args))
    if args.out:
        _write(args, results, round(time.perf_counter() - t0, 1))
        print(f"wrote {args.out}")
    if not results or all("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
