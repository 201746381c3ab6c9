"""Scale benchmark: one full GRPO step of Qwen2.5-14B / 32B-shaped random NVFP4 models on one GPU.

    python -m benchmarks.scale --out $OUT/scale.json                 # 14b,32b on the GPU
    python -m benchmarks.scale --models 32b --phases load,rollout,train --out ...
    python -m benchmarks.scale --tiny --out /tmp/scale.json          # CPU smoke test

What it does:
- prints memory plans (`qerl_jax.memory`): each benchmarked model in NVFP4 on the device,
  Qwen2.5-32B with a bf16 base on an 80 GB H100 and Qwen2.5-72B NVFP4 on a 141 GB H200;
- `loader` phase (own process): writes a random Qwen2.5-0.5B-shaped bf16 checkpoint and loads
  it with `qerl_jax.load_model(path, quant=...)`; peak device memory vs the final footprint;
- per model (own process, so that peak memory is per model): `load` builds the random
  quantized pytree layer by layer on the device (benchmarks/common.py) and compares
  the peak to the final footprint; `rollout` generates prompts x group sequences of
  max-new-tokens (EOS ignored) from prompt-len random prompt tokens; `train` runs the jitted
  GRPO/DAPO train step (LoRA, micro-batches, the recipe's remat and flash attention, chunked
  log-probs) on that batch.

Reported per phase: wall time, compile time (from jax.monitoring compile events) and run
time = wall - compile, peak device memory after the phase (`peak_bytes_in_use`, a process-wide
high-water mark: the train phase's own peak only shows when it exceeds the rollout's, so the
train step's XLA memory analysis is reported too) and the memory plan's estimate.
- rollout: called twice with the same shapes (the first compiles); from the second call's
  prefill and decode times: decode step time, decode tokens/s, and the full rollout time
  prefill + (max_new_tokens - 1) * step with its tokens/s (rows * max_new_tokens / time).
  `--decode-steps N` (default 128) runs only N sampling steps while the KV cache is sized for
  max-new-tokens: a decode step costs the same at every position (static shapes, attention
  over the whole cache), so the full time is extrapolated (0: run all steps).
- train: the packed micro-step and the update AOT-compiled (XLA's memory analysis of the
  micro-step), then one step timed; tokens/s = packed slots (R x L, `rl.packing` rows of
  prompt + max-new-tokens) / step time. The batch is the rollout's tokens, continued with random
  tokens past the decoded steps.
A phase that fails on the pallas backend is re-run on xla (the error is recorded).

GPU time: about 2-3 minutes per model (14b, 32b) with the defaults, compilation included;
`--train-seqs N` trains on the first N sequences only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from benchmarks import with_repo_on_path

GIB = 1024**3
# nvidia-smi totals; XLA_PYTHON_CLIENT_MEM_FRACTION (set to 0.95 below) of them is usable.
H100_BYTES = 81559 * 2**20
H200_BYTES = 143771 * 2**20
MEM_FRACTION = "0.95"

MODELS = ("tiny", "0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")


def model_config(name: str):
    """Qwen2.5-<name> shapes (config.json values), from benchmarks/common.py."""
    from benchmarks import common  # noqa: PLC0415 (imports jax: not before the environment is set)

    return common.model_config(name)


def plan_inputs(args, quant: str | None = None, backend: str | None = None):
    """The `memory.PlanInputs` of the benchmark's sizes."""
    from qerl_jax import memory

    return memory.PlanInputs(
        quant=quant or args.quant,
        lora_rank=args.lora_rank,
        rollout_batch=args.prompts * args.group_size,
        group_size=args.group_size,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch_size or 8,
        max_batch=args.max_batch or None,
        logprob_chunk=args.logprob_chunk,
        remat="proj" if args.remat == "auto" else args.remat,
        attention=args.attention,
        backend=backend or ("xla" if args.backend == "auto" else args.backend),
    )


# ----------------------------------------------------------------------------- plans (parent)


def static_plans(args) -> list[dict[str, Any]]:
    """The memory plans asked for, on nominal devices; no device is touched."""
    from qerl_jax import memory

    if args.tiny:  # the plans are of the real benchmark sizes, not of the smoke test's
        args = parse_args([a for a in args.raw_argv if a != "--tiny"])
    cases = [(m, args.quant, "H100-80GB", H100_BYTES) for m in args.models if m != "tiny"]
    cases += [("32b", "bf16", "H100-80GB", H100_BYTES), ("72b", "nvfp4", "H200-141GB", H200_BYTES)]
    backend = "xla" if args.backend == "xla" else "pallas"  # auto = pallas on a GPU
    out = []
    for model, quant, device, physical in cases:
        usable = int(physical * float(MEM_FRACTION))
        plan = memory.plan_memory(model_config(model), plan_inputs(args, quant, backend), usable)
        try:
            result = memory.fit(plan, usable)
            verdict, fitted = result.message, result.plan
        except memory.DoesNotFitError as e:
            verdict, fitted = f"DOES NOT FIT: {e}", None
        print(f"\n== plan: Qwen2.5-{model.upper()} {quant} on {device} ==")
        print(plan.table())
        print(f"fit: {verdict}")
        if fitted is not None and fitted is not plan and fitted.inputs != plan.inputs:
            print(fitted.table())
        out.append(
            {
                "model": model,
                "quant": quant,
                "device": device,
                "device_bytes": usable,
                "plan": plan.as_dict(),
                "fit": verdict,
                "fitted": fitted.as_dict() if fitted is not None else None,
            }
        )
    return out


# ----------------------------------------------------------------------------- worker helpers


class CompileClock:
    """Sums JAX's compile-event durations (tracing, lowering, backend compile)."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        import jax

        self.total = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event in self.EVENTS:
            self.total += duration


def mem_stats() -> dict[str, int] | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def tree_bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class Phase:
    """Times a phase (wall and compile) and records memory after it."""

    def __init__(self, clock: CompileClock, record: dict[str, Any], name: str):
        self.clock, self.record, self.name = clock, record, name

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), self.clock.total
        self.out: dict[str, Any] = {}
        return self.out

    def __exit__(self, exc_type, exc, tb):
        wall = time.perf_counter() - self.t0
        compile_s = self.clock.total - self.c0
        run = max(wall - compile_s, 0.0)
        self.out.update(wall_s=round(wall, 3), compile_s=round(compile_s, 3), run_s=round(run, 3))
        stats = mem_stats()
        if stats:
            self.out["bytes_in_use_after"] = stats.get("bytes_in_use")
            self.out["peak_bytes_so_far"] = stats.get("peak_bytes_in_use")
        if exc is not None:
            self.out["error"] = f"{exc_type.__name__}: {exc}"
            self.out["traceback"] = traceback.format_exc()[-4000:]
        self.record["phases"][self.name] = self.out
        print(
            f"[{self.record['model']}] {self.name}: "
            + json.dumps({k: v for k, v in self.out.items() if k != "traceback"}),
            flush=True,
        )
        return exc is not None and not isinstance(exc, KeyboardInterrupt)  # record the error, go on


def build_random_params(config, quant: str, seed: int):
    """{"base", "norms"} of random weights, built layer by layer on the device (benchmarks/common.py)."""
    from benchmarks import common  # noqa: PLC0415

    return common.random_params(config, quant=quant, seed=seed)


# ----------------------------------------------------------------------------- model worker


def run_model(args, name: str) -> dict[str, Any]:
    import jax
    import numpy as np

    from benchmarks.common import timed_generate
    from qerl_jax import memory
    from qerl_jax.lora import LoraConfig, init_lora, lora_scale, with_lora
    from qerl_jax.optim import make_optimizer
    from qerl_jax.rl import packing
    from qerl_jax.rl import step as rl_step
    from qerl_jax.rl.losses import LossConfig
    from qerl_jax.rollout import RolloutOptions, SamplingConfig, to_train_batch

    clock = CompileClock()
    config = model_config(name)
    backend = args.backend
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    stats0 = mem_stats() or {}
    limit = stats0.get("bytes_limit")
    record: dict[str, Any] = {
        "model": name,
        "device": str(jax.devices()[0].device_kind),
        "backend": backend,
        "quant": args.quant,
        "bytes_limit": limit,
        "config": dataclasses.asdict(config),
        "phases": {},
    }
    rows = args.prompts * args.group_size
    plan = memory.plan_memory(config, plan_inputs(args, backend=backend), limit)
    mb, chunk = args.micro_batch_size or 8, args.max_batch or rows
    remat = "full" if args.remat == "auto" else args.remat
    if limit is not None:
        try:
            fitted = memory.fit(plan, limit, remat_fallback=args.remat == "auto")
            record["fit"] = fitted.message
            plan = fitted.plan
            mb = args.micro_batch_size or fitted.micro_batch_size
            chunk = args.max_batch or fitted.max_batch
            remat = fitted.remat
        except memory.DoesNotFitError as e:
            record["fit"] = f"DOES NOT FIT (running anyway): {e}"
    print(plan.table(), flush=True)
    print(
        f"[{name}] fit: {record.get('fit', 'device size unknown')}; micro_batch_size={mb}, rollout chunk={chunk}",
        flush=True,
    )
    record.update(plan=plan.as_dict(), micro_batch_size=mb, max_batch=chunk, remat=remat, attention=args.attention)

    params = None
    with Phase(clock, record, "load") as out:
        params = build_random_params(config, args.quant, args.seed)
        jax.block_until_ready(params)
        out["param_bytes"] = tree_bytes(params)
        out["plan_frozen_bytes"] = plan.base_linear + plan.embeddings + plan.biases_norms
        stats = mem_stats()
        if stats:
            out["peak_over_final"] = round(stats["peak_bytes_in_use"] / max(stats["bytes_in_use"], 1), 4)
    if params is None:
        return record

    lcfg = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    lora = init_lora(jax.random.key(args.seed + 1), config, lcfg)
    scale = lora_scale(lcfg)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    state = rl_step.init_train_state(lora, optimizer)
    record["lora_and_optimizer_bytes"] = tree_bytes((state.lora, state.opt_state))

    rng = np.random.default_rng(args.seed)
    prompt_ids = rng.integers(0, config.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    train_rollout = None
    steps = args.decode_steps or args.max_new_tokens

    def plan_for(backend_: str) -> memory.MemoryPlan:
        """The plan with the sizes in use, for the backend a phase ran on."""
        inputs = dataclasses.replace(plan.inputs, micro_batch_size=mb, max_batch=chunk, backend=backend_)
        return memory.plan_memory(config, inputs, limit)

    def with_fallback(out: dict[str, Any], fn):
        """fn(backend); a failure on the pallas backend is recorded and the phase re-run on xla."""
        out["backend"] = backend
        try:
            return fn(backend)
        except Exception as e:  # noqa: BLE001
            if backend != "pallas" or isinstance(e, MemoryError):
                raise
            out["pallas_error"] = f"{type(e).__name__}: {e}"[:500]
        # Retried outside the except block: the traceback's frames hold the failed attempt's
        # device arrays (a KV cache, say) until it is gone.
        gc.collect()
        out["backend"] = "xla"
        print(f"[{name}] pallas backend failed ({out['pallas_error'][:200]}); re-running on xla", flush=True)
        return fn("xla")

    def rollout(max_batch: int, backend: str):
        """(batch, max_batch, timings): `steps` tokens per sequence at the cache size of max_new_tokens."""
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        policy = with_lora(params, state.lora)
        options = RolloutOptions(backend=backend, wgmma_weights=None if args.wgmma == "auto" else False)
        while True:
            try:
                out_, timings = timed_generate(
                    config,
                    policy,
                    prompt_ids,
                    prompt_mask,
                    jax.random.key(args.seed + 2),
                    sampling,
                    group_size=args.group_size,
                    lora_scale=scale,
                    max_batch=max_batch,
                    max_new_tokens_per_seq=steps,
                    options=options,
                )
                return jax.block_until_ready(out_), max_batch, timings
            except MemoryError as e:  # the rollout engine's own estimate refused the rows
                if max_batch <= 1:
                    raise
                print(f"[{name}] rollout max_batch {max_batch} refused ({e}); halving", flush=True)
                max_batch //= 2

    if "rollout" in args.phases:
        with Phase(clock, record, "rollout") as out:

            def two_calls(backend_: str):
                t0 = time.perf_counter()
                _, chunk_, _ = rollout(chunk, backend_)  # compiles; same shapes as the timed call
                out["first_call_s"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                result_, chunk_, timed_ = rollout(chunk_, backend_)
                out["timed_call_s"] = round(time.perf_counter() - t0, 3)
                return result_, chunk_, timed_

            result, chunk, timed = with_fallback(out, two_calls)
            steps_c = np.asarray(result.steps).tolist()
            n_chunks = len(steps_c)
            step_s = timed["decode_s"] / max(sum(s_ - 1 for s_ in steps_c), 1)
            full_s = timed["prefill_s"] + n_chunks * (args.max_new_tokens - 1) * step_s
            out.update(
                sequences=rows,
                prompt_len=args.prompt_len,
                max_new_tokens=args.max_new_tokens,
                decode_steps_run=steps_c,
                max_batch=chunk,
                prefill_s=round(timed["prefill_s"], 4),
                decode_step_s=round(step_s, 5),
                decode_tokens_per_s=round(rows / n_chunks / step_s, 1),
                full_rollout_s=round(full_s, 3),
                full_rollout_extrapolated=steps < args.max_new_tokens,
                tokens_per_s=round(rows * args.max_new_tokens / full_s, 1),
                plan_rollout_peak=plan_for(out["backend"]).rollout_peak,
                engine_estimate_bytes=timed.get("estimated_bytes"),
                wgmma_copy_bytes=timed.get("wgmma_copy_bytes"),
            )
            train_rollout = to_train_batch(result)
            del result

    if "train" in args.phases:
        t_total = args.prompt_len + args.max_new_tokens
        # The full training shape: the rollout's tokens, continued with random tokens where only
        # `steps` were sampled (the step's cost does not depend on the token values).
        ids = rng.integers(0, config.vocab_size, (rows, t_total)).astype(np.int32)
        old = np.full((rows, t_total), -2.0, np.float32)
        if train_rollout is not None:
            width = train_rollout["input_ids"].shape[1]
            ids[:, :width] = np.asarray(train_rollout["input_ids"])
            old[:, :width] = np.asarray(train_rollout["old_logp"])
        resp = np.zeros((rows, t_total), np.int32)
        resp[:, args.prompt_len :] = 1
        batch = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "response_mask": resp,
            "old_logp": np.where(resp > 0, old, 0.0).astype(np.float32),
        }
        train_rollout = None
        n = args.train_seqs or rows
        batch = {k: np.asarray(v)[:n] for k, v in batch.items()}
        batch["advantages"] = rng.standard_normal(n).astype(np.float32)
        frozen = {"base": params["base"], "norms": params["norms"]}
        packed = rl_step.train_arrays(packing.pack_batch(batch, t_total, rows_multiple=mb))
        with Phase(clock, record, "train") as out:
            step = None

            def compile_step(backend_: str):
                nonlocal step
                step = rl_step.TrainStep(
                    config,
                    LossConfig(kind="dapo"),
                    optimizer,
                    lora_scale=scale,
                    backend=backend_,
                    remat=remat,
                    attention=args.attention,
                    micro_batch_size=mb,
                    logprob_chunk=args.logprob_chunk,
                )
                micro_args, update_args = step.lower_args(state, frozen, packed)
                step.update.lower(*update_args).compile()
                return step.micro.lower(*micro_args).compile()  # the step's peak: one micro-batch

            t0 = time.perf_counter()
            compiled = with_fallback(out, compile_step)
            out["aot_compile_s"] = round(time.perf_counter() - t0, 3)
            analysis = compiled.memory_analysis()
            if analysis is not None:
                out["xla_memory"] = {
                    k: int(getattr(analysis, k))
                    for k in (
                        "temp_size_in_bytes",
                        "argument_size_in_bytes",
                        "output_size_in_bytes",
                        "alias_size_in_bytes",
                    )
                    if hasattr(analysis, k)
                }
                xm = out["xla_memory"]
                out["xla_peak_estimate"] = (
                    xm.get("temp_size_in_bytes", 0)
                    + xm.get("argument_size_in_bytes", 0)
                    + (xm.get("output_size_in_bytes", 0) - xm.get("alias_size_in_bytes", 0))
                )
            t1 = time.perf_counter()
            state, metrics = step(state, frozen, packed)  # the programs compiled above
            jax.block_until_ready((state, metrics))
            run = time.perf_counter() - t1
            tokens = int(np.prod(packed["input_ids"].shape))
            out.update(
                sequences=n,
                seq_len=t_total,
                packed_rows=int(packed["input_ids"].shape[0]),
                micro_batch_size=mb,
                logprob_chunk=args.logprob_chunk,
                step_run_s=round(run, 3),
                trained_tokens=tokens,
                tokens_per_s=round(tokens / max(run, 1e-9), 1),
                loss=float(metrics["loss"]),
                grad_norm=float(metrics["grad_norm"]),
                plan_train_peak=plan_for(out["backend"]).train_peak,
            )
    stats = mem_stats()
    if stats:
        record["peak_bytes"] = stats.get("peak_bytes_in_use")
        record["peak_gib"] = round(stats["peak_bytes_in_use"] / GIB, 2)
    record["completed"] = all("error" not in p for p in record["phases"].values())
    return record


# ----------------------------------------------------------------------------- loader worker


def write_random_checkpoint(path: str, config, seed: int = 0) -> int:
    """A random bf16 HF Qwen2 checkpoint (config.json + model.safetensors); returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from qerl_jax.model_io.loader import expected_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            x = np.ones(shape, np.float32)
        else:
            x = rng.standard_normal(shape, np.float32) * 0.02
        tensors[name] = x.astype(ml_dtypes.bfloat16)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    from qerl_jax.model_io.hf_layout import hf_config_dict  # noqa: PLC0415 (imports jax)

    raw = {**hf_config_dict(config), "torch_dtype": "bfloat16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return int(sum(t.nbytes for t in tensors.values()))


def run_loader(args, name: str) -> dict[str, Any]:
    import jax

    import qerl_jax

    clock = CompileClock()
    config = model_config(name)
    record: dict[str, Any] = {"model": f"loader-{name}", "phases": {}, "quant": args.quant}
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as path:
        t0 = time.perf_counter()
        record["checkpoint_bytes"] = write_random_checkpoint(path, config, args.seed)
        record["write_s"] = round(time.perf_counter() - t0, 3)
        with Phase(clock, record, "load_model") as out:
            cfg, params = qerl_jax.load_model(path, quant=args.quant, quant_skip=())
            jax.block_until_ready(params)
            final = tree_bytes(params)
            out["param_bytes"] = final
            out["checkpoint_bytes"] = record["checkpoint_bytes"]
            stats = mem_stats()
            if stats:
                out["peak_over_final"] = round(stats["peak_bytes_in_use"] / max(final, 1), 4)
            q = params["base"]["layers"]["q_proj"]["w"]
            out["q_proj_format"] = getattr(q, "fmt", str(getattr(q, "dtype", "?")))
    record["completed"] = all("error" not in p for p in record["phases"].values())
    return record


# ----------------------------------------------------------------------------- parent


def _row(model, phase, p, plan_key=None) -> str:
    gib = lambda b: f"{b / GIB:7.2f}" if isinstance(b, (int, float)) else "      -"  # noqa: E731
    tps = p.get("tokens_per_s")
    return (
        f"{model:<12} {phase:<22} {p.get('wall_s', 0):8.1f} {p.get('compile_s', 0):8.1f} {p.get('run_s', 0):8.1f} "
        f"{(f'{tps:10.0f}' if tps else '         -')} {gib(p.get('peak_bytes_so_far'))} {gib(p.get(plan_key) if plan_key else None)}"
        + (f"  ERROR: {p['error'][:80]}" if "error" in p else "")
    )


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"\n{'model':<12} {'phase':<22} {'wall_s':>8} {'compile_s':>8} {'run_s':>8} {'tokens/s':>10} {'peakGiB':>7} {'planGiB':>7}"
    )
    for r in results:
        for phase, p in r.get("phases", {}).items():
            plan_key = {"rollout": "plan_rollout_peak", "train": "plan_train_peak"}.get(phase)
            print(_row(r["model"], phase, p, plan_key))
        if "peak_gib" in r:
            print(
                f"{r['model']:<12} {'peak of the process':<22} {r['peak_gib']:.2f} GiB (limit {r.get('bytes_limit', 0) / GIB:.2f} GiB); completed={r.get('completed')}"
            )
        if "worker_error" in r:
            print(f"{r['model']:<12} worker failed: {r['worker_error'][:200]}")


def run_worker_subprocess(args, kind: str, model: str) -> dict[str, Any]:
    env = with_repo_on_path(dict(os.environ))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    argv = [sys.executable, "-m", __spec__.name, "--worker", kind, "--model", model, "--result-file", result_path]
    argv += args.raw_argv
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, timeout=args.worker_timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        with open(result_path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError):
        record = {"model": model if kind == "model" else f"loader-{model}", "phases": {}}
    finally:
        if os.path.exists(result_path):
            os.remove(result_path)
    record["process_wall_s"] = round(time.perf_counter() - t0, 1)
    if rc != 0:
        record["worker_error"] = f"worker exited with {rc}"
    return record


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--models", default="14b,32b", help=f"comma list from {MODELS}")
    p.add_argument("--phases", default="loader,load,rollout,train", help="comma list of loader,load,rollout,train")
    p.add_argument("--loader-model", default="0.5b", help="shape of the random checkpoint of the loader phase")
    p.add_argument("--quant", default="nvfp4", choices=("nvfp4", "mxfp4", "nf4", "bf16"))
    p.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"), help="auto: pallas on GPU")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument(
        "--decode-steps",
        type=int,
        default=128,
        help="sampling steps run (KV cache still sized for max-new-tokens; 0: all); the full rollout time is extrapolated",
    )
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument(
        "--wgmma", default="auto", choices=("auto", "off"), help="the Hopper wgmma decode kernel (generate's default)"
    )
    p.add_argument("--micro-batch-size", type=int, default=0, help="0: chosen by memory.fit")
    p.add_argument("--max-batch", type=int, default=0, help="0: chosen by memory.fit")
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--remat", default="auto", help="auto (the training loop's choice) | full | proj | none")
    p.add_argument("--attention", default="flash", choices=("flash", "xla"))
    p.add_argument("--train-seqs", type=int, default=0, help="train on the first N sequences (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    p.add_argument("--plans-only", action="store_true")
    p.add_argument("--worker-timeout", type=int, default=900)
    p.add_argument("--tmpdir", default=None, help="where the loader phase writes its checkpoint")
    p.add_argument("--worker", choices=("model", "loader"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.models = "tiny"
        args.loader_model = "tiny"
        args.prompts, args.group_size, args.prompt_len, args.max_new_tokens = 2, 2, 16, 16
        args.decode_steps = min(args.decode_steps, 8)
        args.lora_rank, args.logprob_chunk = 4, 8
        args.micro_batch_size = args.micro_batch_size or 2
    args.models = [m for m in args.models.split(",") if m]
    args.phases = [p_ for p_ in args.phases.split(",") if p_]
    unknown = set(args.phases) - {"loader", "load", "rollout", "train"}
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}")
    for m in args.models + [args.loader_model]:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; expected one of {MODELS}")
    if args.decode_steps and args.decode_steps > args.max_new_tokens:
        p.error("--decode-steps cannot exceed --max-new-tokens")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        try:
            record = run_model(args, args.model) if args.worker == "model" else run_loader(args, args.model)
        except Exception:  # noqa: BLE001 (recorded for the parent)
            record = {"model": args.model, "phases": {}, "worker_error": traceback.format_exc()[-4000:]}
            print(record["worker_error"], file=sys.stderr, flush=True)
        with open(args.result_file, "w") as f:
            json.dump(record, f)
        return 0 if "worker_error" not in record else 1

    t0 = time.perf_counter()
    skip = ("worker", "model", "result_file", "raw_argv")
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k not in skip}}
    report["plans"] = static_plans(args)
    results = []
    if not args.plans_only:
        if "loader" in args.phases:
            results.append(run_worker_subprocess(args, "loader", args.loader_model))
        if {"load", "rollout", "train"} & set(args.phases):
            for model in args.models:
                results.append(run_worker_subprocess(args, "model", model))
                if args.out:  # partial results survive a later timeout
                    _write(args.out, {**report, "results": results})
    report["results"] = results
    report["total_wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(results)
    print(f"\ntotal wall time {report['total_wall_s']:.1f}s")
    if args.out:
        _write(args.out, report)
    failed = [r["model"] for r in results if not r.get("completed") or "worker_error" in r]
    return 1 if failed else 0


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
