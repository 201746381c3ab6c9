"""Train-step benchmark: one GRPO micro-batch on a Qwen2.5-7B-shaped random model with LoRA.

    PYTHONPATH=. python benchmarks/train_step.py --out $OUT/train_step.json      # GPU: 7B, 8 x 1024
    PYTHONPATH=. python benchmarks/train_step.py --tiny --out /tmp/train_step.json  # CPU smoke test

For each base format (bf16, nf4, nvfp4) a child process builds the random model on the device
(benchmarks/random_model.py), then runs the jitted train step (`qerl_jax.rl.step`) with
gradient checkpointing on (the batch as one micro-batch), then off (the same batch as accumulated
micro-batches of --no-remat-micro-batch-size, since all of it does not fit): compile time, the median step time over `--steps` timed
steps after one warm-up step, tokens/s, XLA's memory analysis of the compiled step, and the
device's peak memory (`memory_stats()["peak_bytes_in_use"]`). The peak is a process-wide
high-water mark; running remat=on before remat=off in one process still gives each case its
own peak because the no-remat step needs at least as much memory (`--isolate` runs one process per
case instead). An out-of-memory case is reported as such and the run goes on.
Prints a table and writes all results as JSON to --out.
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

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_PREFIX = "RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test)")
    p.add_argument("--model", default="7B", help="Qwen2.5 size (0.5B ... 72B)")
    p.add_argument("--formats", default="bf16,nf4,nvfp4", help="comma-separated base formats")
    p.add_argument("--remat", default="on,off", help="comma-separated: on, off (run in this order)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--batch", type=int, default=8, help="sequences in the micro-batch")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + response)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=None, help="with remat; default: the whole batch")
    p.add_argument(
        "--no-remat-micro-batch-size",
        type=int,
        default=2,
        help="without remat, the same batch runs as accumulated micro-batches of this size (the whole "
        "8 x 1024 batch needs ~140 GB without checkpointing); 0: the --micro-batch-size value",
    )
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--loss", default="grpo", choices=("grpo", "dapo"))
    p.add_argument("--beta", type=float, default=0.0, help="GRPO KL weight (> 0 adds the reference forward)")
    p.add_argument("--backend", default="xla", choices=("xla", "pallas"))
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--isolate", action="store_true", help="one process per (format, remat) case")
    p.add_argument("--timeout", type=float, default=170.0, help="seconds per child process")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child mode: "fmt:remat[,remat]"
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.model, args.batch, args.seq, args.prompt_len, args.logprob_chunk, args.rank = "tiny", 4, 64, 16, 16, 4
    return args


def _mem_stats() -> dict[str, int] | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 (some backends do not implement it)
        return None
    return stats or None


def run_case(args, fmt: str, remats: list[bool]) -> list[dict[str, Any]]:
    """Child: build the model once, then time the step for each remat setting in order."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, HERE)
    import random_model  # benchmarks/random_model.py

    from qerl_jax.lora import LoraConfig, init_lora, lora_scale
    from qerl_jax.optim import make_optimizer
    from qerl_jax.rl import step as rl_step
    from qerl_jax.rl.losses import LossConfig

    config = random_model.model_config(args.model)
    t0 = time.perf_counter()
    params = random_model.random_params(config, quant=fmt, seed=0)
    build_s = time.perf_counter() - t0
    frozen = {"base": params["base"], "norms": params["norms"]}
    lcfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=1000)
    batch = random_model.random_rl_batch(config, batch=args.batch, seq_len=args.seq, prompt_len=args.prompt_len)
    mb_remat = args.micro_batch_size or args.batch
    mb_plain = args.no_remat_micro_batch_size or mb_remat
    rl_step.validate_batch(batch, mb_remat)
    rl_step.validate_batch(batch, mb_plain)
    clean = {
        "input_ids": jnp.asarray(batch["input_ids"], jnp.int32),
        "attention_mask": jnp.asarray(batch["attention_mask"], jnp.int32),
        "response_mask": jnp.asarray(batch["response_mask"], jnp.float32),
        "old_logp": jnp.asarray(batch["old_logp"], jnp.float32),
        "advantages": jnp.asarray(batch["advantages"], jnp.float32),
    }
    loss_cfg = LossConfig(kind=args.loss, eps_low=0.2, eps_high=0.28, beta=args.beta)
    base_info = {
        "model": args.model,
        "format": fmt,
        "device": str(jax.devices()[0].device_kind),
        "backend": args.backend,
        "lora_rank": args.rank,
        "batch": args.batch,
        "seq": args.seq,
        "logprob_chunk": args.logprob_chunk,
        "loss": args.loss,
        "beta": args.beta,
        "frozen_bytes": random_model.tree_bytes(frozen),
        "build_s": round(build_s, 2),
    }
    results = []
    for remat in remats:
        mb = mb_remat if remat else mb_plain
        out = dict(base_info, remat=remat, micro_batch_size=mb)
        state = compiled = None
        try:
            state = rl_step.init_train_state(init_lora(jax.random.key(1), config, lcfg), optimizer)
            out["lora_and_opt_bytes"] = random_model.tree_bytes((state.lora, state.opt_state))
            step = rl_step.make_train_step(
                config,
                loss_cfg,
                optimizer,
                lora_scale=lora_scale(lcfg),
                backend=args.backend,
                remat=remat,
                micro_batch_size=mb,
                logprob_chunk=args.logprob_chunk,
            )
            t0 = time.perf_counter()
            compiled = step.jitted.lower(state, frozen, clean, None).compile()
            out["compile_s"] = round(time.perf_counter() - t0, 2)
            analysis = compiled.memory_analysis()
            if analysis is not None:
                xm = {
                    k: int(getattr(analysis, k))
                    for k in (
                        "temp_size_in_bytes",
                        "argument_size_in_bytes",
                        "output_size_in_bytes",
                        "alias_size_in_bytes",
                    )
                    if hasattr(analysis, k)
                }
                out["xla_memory"] = xm
                out["xla_peak_estimate_bytes"] = (
                    xm.get("temp_size_in_bytes", 0)
                    + xm.get("argument_size_in_bytes", 0)
                    + xm.get("output_size_in_bytes", 0)
                    - xm.get("alias_size_in_bytes", 0)
                )
            times = []
            for i in range(args.steps + 1):  # the first step is a warm-up
                t0 = time.perf_counter()
                state, metrics = compiled(state, frozen, clean, None)
                jax.block_until_ready((state, metrics))
                if i:
                    times.append(time.perf_counter() - t0)
            step_s = statistics.median(times)
            out.update(
                step_s=round(step_s, 4),
                step_times_s=[round(t, 4) for t in times],
                tokens_per_s=round(args.batch * args.seq / step_s, 1),
                loss=float(metrics["loss"]),
                grad_norm=float(metrics["grad_norm"]),
                skipped=float(metrics["skipped"]),
            )
        except Exception as e:  # noqa: BLE001 (an OOM case is a result, not a crash)
            msg = f"{type(e).__name__}: {e}"
            out["error"] = (
                "OOM: " + msg[:500] if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() else msg[:2000]
            )
            out["traceback"] = traceback.format_exc()[-3000:]
        stats = _mem_stats()
        if stats:
            out["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
            out["bytes_limit"] = stats.get("bytes_limit")
        del state, compiled
        results.append(out)
        print(RESULT_PREFIX + json.dumps(out), flush=True)
    return results


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the no-remat cases need more than the default 75%
    root = os.path.dirname(HERE)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_children(args) -> list[dict[str, Any]]:
    """Driver: one child process per format (or per case with --isolate); collects RESULT lines."""
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    remats = [r.strip() for r in args.remat.split(",") if r.strip()]
    bad = [r for r in remats if r not in ("on", "off")]
    if bad:
        raise SystemExit(f"--remat values must be 'on' or 'off'; got {bad}")
    jobs = [(f, [r]) for f in formats for r in remats] if args.isolate else [(f, remats) for f in formats]
    passthrough, skip_next = [], False
    for a in args.argv:  # the child gets the same flags, minus --out
        if skip_next:
            skip_next = False
        elif a == "--out":
            skip_next = True
        elif not a.startswith("--out="):
            passthrough.append(a)
    results = []
    for fmt, rs in jobs:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--case", f"{fmt}:{','.join(rs)}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=args.timeout)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = f"timed out after {args.timeout} s", None
        got = [json.loads(line[len(RESULT_PREFIX) :]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        for r in rs[len(got) :]:  # cases the child never reported (crash or timeout)
            got.append({"format": fmt, "remat": r == "on", "error": f"child exited with {rc}: {stderr[-1500:]}"})
        for g in got:
            g["process_s"] = round(time.perf_counter() - t0, 1)
        results.extend(got)
        print(f"[{fmt}] {len(got)} case(s) in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'format':8} {'remat':5} {'micro':>5} {'step s':>8} {'tok/s':>9} {'peak GiB':>9} {'XLA est GiB':>11} {'frozen GiB':>10} {'compile s':>9}  note"
    lines = [head, "-" * len(head)]
    for r in results:
        note = r.get("error", "")[:60]
        lines.append(
            f"{r.get('format', '?'):8} {('on' if r.get('remat') else 'off'):5} {r.get('micro_batch_size', '-')!s:>5} "
            f"{r.get('step_s', '-')!s:>8} "
            f"{r.get('tokens_per_s', '-')!s:>9} {_gib(r.get('peak_bytes_in_use')):>9} "
            f"{_gib(r.get('xla_peak_estimate_bytes')):>11} {_gib(r.get('frozen_bytes')):>10} {r.get('compile_s', '-')!s:>9}  {note}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        fmt, rs = args.case.split(":")
        run_case(args, fmt, [r == "on" for r in rs.split(",")])
        return
    t0 = time.perf_counter()
    results = run_children(args)
    print(table(results))
    summary = {
        "args": {k: v for k, v in vars(args).items() if k not in ("case", "argv")},
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": results,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.out}")
    if not results or all("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
