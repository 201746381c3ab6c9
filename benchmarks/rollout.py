"""Rollout throughput: our jitted KV-cache generation (bf16 / NF4 / MXFP4 / NVFP4) vs transformers.

    python -m benchmarks.rollout --out $OUT/rollout.json          # GPU, Qwen2.5-7B shapes
    python -m benchmarks.rollout --tiny --out /tmp/rollout.json   # CPU smoke test
    python -m benchmarks.rollout --workload gsm8k --out $OUT/gsm8k.json         # GPU
    python -m benchmarks.rollout --workload gsm8k --tiny --out /tmp/gsm8k.json  # CPU smoke
    python -m benchmarks.rollout --model 1.5B --lora-rank 16 --batches 1x1,2x8,8x8,16x16 --out $OUT/r15.json

--model picks the Qwen2.5 shapes of the random model (default 7B); --prompts / --group / --max-new
resize the gsm8k workload (e.g. the 1.5B claims experiment's 16 x 8 at 768 tokens).

Two workloads. "decode" (default, below): decode-step time at fixed batches. "gsm8k": whole GRPO
rollouts of the GSM8K recipe (`configs/gsm8k.py`): Qwen2.5-7B shapes, 32 prompts x 8 samples,
256-token prompts, up to 2048 new tokens, LoRA rank 16 on every projection, and per-sequence
completion lengths drawn from a stand-in for real completions (`completion_lengths`: log-normal,
median 300 tokens, clipped at 2048 so that ~5% of the rows run to the cap; seeded), enforced by
each row's token limit (ours: `generate(max_new_tokens_per_seq=...)`; transformers: a logits
processor forcing EOS at the row's length, banning it before). Rows: NVFP4 and bf16 with
continuous batching (refill, compaction into 64 / 16 rows, length-aware decode attention with
--attention), NVFP4 decoding from its bf16 copies at every row count (`nvfp4:xla`, no W4A16 or
wgmma kernel), and transformers' generate (static cache, torch.compile on CUDA). Per row: wall time of the first
call (compile included), compile time (the engine compiles its programs up front, concurrently),
rollout time (wall - compile; the best of the first and warm calls), generated tokens/s, peak
memory and the engine's estimate. (The fixed-batch schedule's rows, the engine before continuous
batching, left with that schedule; RESULTS.md keeps the comparison with it.)
Expected on an H100: ~8 minutes in all (each JAX format compiles ~4 programs of ~30-45 s
concurrently, ~1-1.5 min; rollouts 10-60 s each; transformers compiles ~1-2 min, ~1-1.5 min run).

Decode workload:

Model: Qwen2.5-7B shapes with random weights (no checkpoint): dense bf16 N(0, 0.02), or 4-bit
packed weights with random codes and scales sized so the dequantized weights have a similar
scale (built directly in packed form, so no bf16 copy inflates the memory peak). Prompts:
256 random tokens, temperature-1 sampling with EOS ignored.

Batches (prompts x group): 32 x 8 = 256 (GRPO-sized), 1 x 1 and 8 x 8 = 64 sequences, in that
order. The cache is sized for 512 new tokens (S = 256 + 512) but only 32 and 160 sampling
steps are run (a decode step costs the same at every position: static shapes read the whole
cache). The step is the difference of the two calls' fastest wall times over their 128 steps
(`common.decode_step_seconds`: each call's host work cancels), and end-to-end numbers for 512
tokens are extrapolated: e2e = B * 512 / (ttft + 511 * step).

Columns: ttft (per-layer weight copies + prefill of the distinct prompts + first token),
decode step time, decode tokens/s, e2e tokens/s, the physical limit of a decode step =
max((weight bytes but the embedding + KV bytes read per step) / copy bandwidth, 2 * params * B /
matmul peak), both measured on the device, and its fraction reached, weight bytes, peak GPU
bytes. Each (format, backend) and the transformers peer (torch bf16, static cache, which
transformers compiles with torch.compile on CUDA by itself) runs in its own subprocess; a JAX
process peak (peak_bytes_in_use) is monotone, so only the first row of a process (B = 256)
gets one; estimated_peak_bytes (weights + `estimate_rollout_bytes`) is in the JSON for every
row. The bf16 B = 256 row also times the prefill without group sharing (B * G rows).
launches: kernel launches per decode step of the bf16 (backend "xla") and NVFP4 ("pallas") rows,
counted after the workers by `devtools/hlo_census.py` on the CPU, for an H100, the weight copies
those `generate` makes without a memory limit (needs jax's CUDA plugin; without it the table says
why it has none).

Time: each (format, backend, batch) compiles a prefill and a decode program (~20 s for bf16,
more with Pallas kernels). Workers run in priority order (bf16, nvfp4-pallas, transformers,
nvfp4-xla, mxfp4/nf4-pallas, mxfp4/nf4-xla) and nothing new starts after --deadline seconds
(default 290), so a 5-minute call may leave the last rows out (listed as skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback

from benchmarks import with_repo_on_path

QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
    attention_bias=True,
    max_position_embeddings=32768,
)
TINY = dict(
    QWEN25_7B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)


def model_dict(args) -> dict:
    """The ModelConfig fields of the run's model: TINY with --tiny, else the Qwen2.5 size --model."""
    if args.tiny:
        return dict(TINY)
    import dataclasses as _dc  # noqa: PLC0415

    from benchmarks.common import model_config  # noqa: PLC0415

    fields = _dc.asdict(model_config(args.model))
    return {k: fields[k] for k in QWEN25_7B}


FULL_RUN = dict(prompt_len=256, new_tokens=512, batches=((1, 1), (8, 8), (32, 8)), steps=32, long_steps=160)
TINY_RUN = dict(prompt_len=16, new_tokens=32, batches=((1, 1), (2, 2), (4, 2)), steps=8, long_steps=24)
GSM8K_RUN = dict(prompts=32, group=8, prompt_len=256, max_new=2048, lora_rank=16, median=300, cap_fraction=0.05)
# The tiny run compacts 16 rows into 8 and 4 (the full run: 256 into generate's default 64 and 16).
TINY_GSM8K_RUN = dict(
    prompts=4, group=4, prompt_len=16, max_new=96, lora_rank=4, median=12, cap_fraction=0.1, smaller_rows=(8, 4)
)
# The gsm8k workload's workers, by importance; each entry: (worker, its variants (name, generate
# `RolloutOptions` fields, warm calls after the first, while the deadline allows).
GSM8K_WORKERS = (
    ("nvfp4:pallas", (("continuous", {}, 1),)),
    ("bf16:xla", (("continuous", {}, 1),)),
    ("transformers", ()),
    # NVFP4 decoding from its per-call bf16 copies at every row count (no W4A16 / wgmma kernel):
    # what the kernels' buckets win or lose against the same weights as dense dots.
    ("nvfp4:xla", (("continuous", {}, 1),)),
)
FORMATS = ("bf16", "nvfp4", "mxfp4", "nf4")
# One subprocess each, in order of importance: the last ones are the first cut by --deadline.
WORKER_ORDER = (
    "bf16:xla",
    "nvfp4:pallas",
    "transformers",
    "nvfp4:xla",
    "mxfp4:pallas",
    "nf4:pallas",
    "mxfp4:xla",
    "nf4:xla",
)
PROJ_SHAPES = {  # (N, K) as functions of the config
    "q_proj": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
    "k_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "v_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "o_proj": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "gate_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "up_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "down_proj": lambda c: (c["hidden_size"], c["intermediate_size"]),
}


# ----------------------------------------------------------------------------- random model


def build_random_params(config, fmt: str, key):
    """Random Qwen2 params {"base", "norms"}: bf16 or `fmt`-quantized linears, built layer by
    layer on the device by benchmarks/common.py (the seed comes from `key`)."""
    import jax

    from benchmarks import common

    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    return common.random_params(config, quant=fmt, seed=seed)


def with_random_lora(params, config, rank: int) -> tuple[dict, dict]:
    """(params with LoRA of `rank` on every projection, alpha 2 x rank, B = 0 as at the start of training:
    the deltas are computed all the same; `generate`'s lora_scale keyword). Rank 0: the params as they
    are and no keyword."""
    if not rank:
        return params, {}
    import jax

    from qerl_jax.lora import LoraConfig, init_lora, lora_scale, with_lora  # noqa: PLC0415

    lcfg = LoraConfig(rank=rank, alpha=2.0 * rank)
    return with_lora(params, init_lora(jax.random.key(1), config, lcfg)), {"lora_scale": lora_scale(lcfg)}


def tree_bytes(tree) -> int:
    from benchmarks import common

    return common.tree_bytes(tree)


# ----------------------------------------------------------------------------- device ceilings


def measure_device(tiny: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    import jax
    import jax.numpy as jnp

    def best_seconds(fn, arg, reps=5):
        fn(arg).block_until_ready()  # compile + warm up
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(arg).block_until_ready()
            ts.append(time.perf_counter() - t)
        return min(ts)

    # Random data, not constants: constant inputs can run faster than real ones.
    n = (1 << 20) if tiny else (1 << 30)  # 2 GiB of bf16
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    bw = 2 * x.nbytes / best_seconds(jax.jit(lambda a: a + jnp.bfloat16(1)), x)
    m = 512 if tiny else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    flops = 2 * m**3 / best_seconds(jax.jit(lambda a: a @ a), a)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": flops, "device": str(jax.devices()[0])}


# ----------------------------------------------------------------------------- workers


def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _save_partial(args, out: dict) -> None:
    """Written after every row, so a worker killed at its time limit still reports its rows."""
    with open(args.worker_out, "w") as f:
        json.dump(out, f, default=str)


def _batches_largest_first(run: dict) -> list[tuple[int, int]]:
    # The GRPO-sized batch first: it matters most if the deadline cuts the rest, and a JAX
    # process peak (monotone) is attributable only to its first row.
    return sorted(run["batches"], key=lambda b: -b[0] * b[1])


def run_config(args) -> dict:
    """The run's sizes: TINY_RUN or FULL_RUN, with --batches (prompts x group) if given."""
    run = dict(TINY_RUN if args.tiny else FULL_RUN)
    if args.batches:
        run["batches"] = tuple(tuple(int(v) for v in b.split("x")) for b in args.batches.split(","))
    return run


def jax_worker(args, fmt: str, backend: str) -> dict:
    import jax
    import numpy as np

    import qerl_jax.rollout as rollout
    from benchmarks.common import decode_step_seconds, timed_generate
    from qerl_jax.models.qwen2 import ModelConfig

    run = run_config(args)
    config = ModelConfig(**model_dict(args))
    out = {"format": fmt, "backend": backend, "rows": [], "errors": []}
    if backend == "pallas":
        try:
            import pallas_kernels

            pallas_kernels.quant_matmul  # noqa: B018 (raises AttributeError when missing)
        except (ImportError, AttributeError) as e:
            out["errors"].append(f"pallas backend unavailable: {e}")
            return out
    if args.measure_device:
        out["device_ceilings"] = measure_device(args.tiny)
    t = time.perf_counter()
    params = build_random_params(config, fmt, jax.random.key(0))
    out["build_s"] = time.perf_counter() - t
    out["weight_bytes"] = tree_bytes(params)
    params, lora_kw = with_random_lora(params, config, args.lora_rank)
    if args.lora_rank:
        out["lora_rank"] = args.lora_rank
    out["linear_weight_bytes"] = tree_bytes(params["base"]["layers"])
    out["peak_after_build"] = peak_bytes()
    rng = np.random.default_rng(0)
    # The cache is sized for new_tokens; every row stops after `steps` tokens (its token limit).
    sampling = rollout.SamplingConfig(temperature=1.0, max_new_tokens=run["new_tokens"], ignore_eos=True)
    attention = args.attention if args.attention != "auto" else rollout.decode_attention_backend(None)
    out["decode_attention"] = attention
    for index, (prompts, group) in enumerate(_batches_largest_first(run)):
        ids = rng.integers(0, config.vocab_size, (prompts, run["prompt_len"]), dtype=np.int32)
        mask = np.ones_like(ids)
        if time.time() > args.deadline_at:
            out["errors"].append(f"deadline reached before {fmt}/{backend}/B={prompts * group}")
            continue
        row = {"format": fmt, "backend": backend, "prompts": prompts, "group": group, "batch": prompts * group}
        try:
            # One row bucket: every row runs the same steps (no compaction), the decode step is timed;
            # every format with the same decode attention (--attention).
            opts = rollout.RolloutOptions(backend=backend, smaller_rows=(), decode_attention=attention)
            kw = dict(group_size=group, **lora_kw)

            def timed(seed, steps=run["steps"], ids=ids, mask=mask, kw=kw, opts=opts, **extra):
                """One rollout on this batch, each row `steps` tokens -> (its output, its timings)."""
                options = dataclasses.replace(opts, **extra)
                key = jax.random.key(seed)
                return timed_generate(
                    config, params, ids, mask, key, sampling, **kw, max_new_tokens_per_seq=steps, options=options
                )

            def step_seconds(**extra) -> tuple[float, list[dict]]:
                """Warm decode step time (`decode_step_seconds`: short and long calls, args.reps of
                each, alternating) and the short calls' timings."""
                short, long = [], []
                for r in range(args.reps):
                    short.append(timed(2 + r, **extra)[1])
                    long.append(timed(2 + r, steps=run["long_steps"], **extra)[1])
                return decode_step_seconds(short, long), short

            t = time.perf_counter()
            b, first = timed(1)
            first_call = time.perf_counter() - t
            step_s, reps = step_seconds()
            best = min(reps, key=lambda tm: tm["wall_s"])
            steps = best["steps"]
            # Time to first token: the per-layer weight copies + prefill + first sample.
            ttft = min(tm["prefill_s"] for tm in reps)
            # generate's default plan (its weight copies and memory estimate, no memory limit)
            plan = rollout.plan_rollout(
                config,
                params,
                prompts * group,
                rollout.prompt_bucket(run["prompt_len"]),
                run["new_tokens"],
                group_size=group,
                max_batch=prompts * group,
                options=opts,
            )
            dense_names, wgmma_names = plan.dense_names, plan.wgmma_names
            if args.compare_wgmma and wgmma_names:  # the same rollout with the Triton kernel instead
                timed(1, wgmma_weights=False)  # compiles
                row["decode_step_s_without_wgmma"] = step_seconds(wgmma_weights=False)[0]
            if args.compare_unfused and rollout.weights.fused_groups(wgmma_names):  # one kernel call per projection
                fusable, rollout.weights.FUSED_GROUPS = rollout.weights.FUSED_GROUPS, ()
                try:
                    timed(1)  # compiles
                    row["decode_step_s_unfused"] = step_seconds()[0]
                finally:
                    rollout.weights.FUSED_GROUPS = fusable
            if args.compare_norm_parts and prompts * group == 1:  # the one-row step with its norms whole
                timed(1, norm_parts=False)  # compiles
                row["decode_step_s_whole_norms"] = step_seconds(norm_parts=False)[0]
            row.update(
                wgmma_weights=list(wgmma_names),
                ttft_s=ttft,
                decode_step_s=step_s,
                steps=steps,
                compile_s=first_call - (best["prefill_s"] + best["wall_s"]),
                long_steps=run["long_steps"],
                decode_tokens_per_s=prompts * group / step_s,
                e2e_tokens_per_s=prompts * group * run["new_tokens"] / (ttft + (run["new_tokens"] - 1) * step_s),
                finite_logprobs=bool(np.isfinite(np.asarray(b.logprobs)).all()),
                peak_bytes=peak_bytes() if index == 0 else None,
                dense_weights=list(dense_names),
                # What generate's memory check predicts, for comparison with the measured peak.
                estimated_peak_bytes=out["weight_bytes"] + plan.memory.total,
            )
            if args.no_sharing_row and group > 1 and index == 0:
                for _ in range(2):  # compile, then time
                    _, tm = timed(1, share_prefill=False)
                row["ttft_no_sharing_s"] = tm["prefill_s"]
        except Exception as e:  # noqa: BLE001 (report and go on with the next variant)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["errors"].append(traceback.format_exc()[-3000:])
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        _save_partial(args, out)
    return out


def torch_worker(args) -> dict:
    """transformers' generate, torch bf16, static cache of the same size, sampling at T = 1.

    On CUDA, transformers compiles the decode step with torch.compile by itself when a static
    cache is used (its default "auto-compile"); the first call of each batch size pays that.
    The batch of 256 runs first (the most relevant one, in case the deadline cuts the rest).
    """
    import torch
    import transformers

    from benchmarks import common
    from qerl_jax.models.qwen2 import ModelConfig  # noqa: PLC0415

    run = run_config(args)
    cfg_dict = model_dict(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {
        "format": "transformers",
        "rows": [],
        "errors": [],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    t = time.perf_counter()
    model = common.hf_model(ModelConfig(**cfg_dict), device=device, use_cache=True).eval()
    hf_config = model.config
    out["build_s"] = time.perf_counter() - t
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)

    def run_generate(ids, group, new_tokens):
        cache = transformers.StaticCache(config=model.config, max_cache_len=run["prompt_len"] + run["new_tokens"])
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=group,
                past_key_values=cache,
                pad_token_id=0,
            )

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, res

    compiled = device == "cuda"
    backend = "torch.compile-static-cache" if compiled else "torch-eager-static-cache"
    for prompts, group in _batches_largest_first(run):
        row = {
            "format": "transformers",
            "backend": backend,
            "prompts": prompts,
            "group": group,
            "batch": prompts * group,
        }
        if time.time() > args.deadline_at:
            out["errors"].append(f"deadline reached before transformers B={prompts * group}")
            continue
        try:
            ids = torch.randint(0, hf_config.vocab_size, (prompts, run["prompt_len"]), generator=gen).to(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            gen_for = lambda n, ids=ids, group=group: lambda: run_generate(ids, group, n)  # noqa: E731
            row["first_call_s"], _ = timed(gen_for(3))  # warm-up (and compile)
            ttft, _ = min((timed(gen_for(1)) for _ in range(args.reps)), key=lambda x: x[0])
            calls = {n: [timed(gen_for(n)) for _ in range(args.reps)] for n in (run["steps"], run["long_steps"])}
            res = calls[run["steps"]][-1][1]
            assert res.shape == (prompts * group, run["prompt_len"] + run["steps"]), res.shape
            short, long = ([{"steps": n, "wall_s": wall} for wall, _ in calls[n]] for n in calls)
            step_s = common.decode_step_seconds(short, long)
            row.update(
                ttft_s=ttft,
                decode_step_s=step_s,
                steps=run["steps"],
                decode_tokens_per_s=prompts * group / step_s,
                e2e_tokens_per_s=prompts * group * run["new_tokens"] / (ttft + (run["new_tokens"] - 1) * step_s),
                peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
            )
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["errors"].append(traceback.format_exc()[-3000:])
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        _save_partial(args, out)
    return out


# ----------------------------------------------------------------------------- gsm8k workload


def completion_lengths(n: int, *, median: float, max_new: int, cap_fraction: float, seed: int = 0):
    """int32 [n] completion lengths: log-normal with `median`, its sigma set so that a fraction
    `cap_fraction` of the draws reach `max_new` (sigma = ln(max_new / median) / z, z the normal
    quantile of 1 - cap_fraction: 1.168 for 300 / 2048 / 5%), rounded up and clipped to
    [1, max_new]. A stand-in for GRPO completions: most stop after a few hundred tokens, a few
    run to the cap. Seeded (numpy default_rng(seed))."""
    import statistics  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    sigma = math.log(max_new / median) / statistics.NormalDist().inv_cdf(1.0 - cap_fraction)
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, size=n)
    return np.clip(np.ceil(draws), 1, max_new).astype(np.int32)


def gsm8k_inputs(args):
    """(run sizes, prompt ids [prompts, prompt_len], lengths [prompts * group]); seeded."""
    import numpy as np  # noqa: PLC0415

    run = dict(TINY_GSM8K_RUN if args.tiny else GSM8K_RUN)
    for name in ("prompts", "group", "max_new"):
        if getattr(args, name, None):
            run[name] = getattr(args, name)
    vocab = model_dict(args)["vocab_size"]
    ids = np.random.default_rng(1).integers(1, vocab, (run["prompts"], run["prompt_len"]), dtype=np.int32)
    n = run["prompts"] * run["group"]
    lengths = completion_lengths(n, median=run["median"], max_new=run["max_new"], cap_fraction=run["cap_fraction"])
    return run, ids, lengths


EOS_ID = 2  # the stand-in EOS of the workload (random weights: any id)


def gsm8k_jax_worker(args, fmt: str, backend: str, variants) -> dict:
    """One generate call per variant (cold: its programs compiled up front, timed apart), then
    --reps warm calls while the deadline allows."""
    import jax
    import numpy as np

    import qerl_jax.rollout as rollout
    from benchmarks.common import CompileTimeline, timed_generate
    from qerl_jax.models.qwen2 import ModelConfig

    run, ids, lengths = gsm8k_inputs(args)
    config = ModelConfig(**model_dict(args))
    out = {"format": fmt, "backend": backend, "rows": [], "errors": []}
    timeline = CompileTimeline()
    t = time.perf_counter()
    params = build_random_params(config, fmt, jax.random.key(0))
    params, lora_kw = with_random_lora(params, config, run["lora_rank"])
    jax.block_until_ready(params)
    out["build_s"] = time.perf_counter() - t
    out["weight_bytes"] = tree_bytes(params)
    sampling = rollout.SamplingConfig(temperature=1.0, max_new_tokens=run["max_new"], ignore_eos=True)
    attention = args.attention if args.attention != "auto" else rollout.decode_attention_backend(None)
    for name, extra, warm in variants:
        row = {
            "format": fmt,
            "backend": backend,
            "variant": name,
            "attention": extra.get("decode_attention", attention),
        }
        if time.time() > args.deadline_at:
            out["errors"].append(f"deadline reached before {fmt}/{name}")
            continue
        opts = dict(backend=backend, decode_attention=attention)
        if "smaller_rows" in run:
            opts["smaller_rows"] = run["smaller_rows"]
        opts.update(extra)
        kw = dict(group_size=run["group"], **lora_kw, options=rollout.RolloutOptions(**opts))
        try:
            calls = []
            out["rows"].append(row)
            for rep in range(1 + (warm if args.reps is None else args.reps)):
                if rep and time.time() > args.deadline_at:
                    break
                t0 = time.time()
                batch, tm = timed_generate(
                    config, params, ids, np.ones_like(ids), jax.random.key(2), sampling,
                    max_new_tokens_per_seq=lengths, **kw,
                )  # fmt: skip
                spent = timeline.summary(t0, time.time())
                calls.append(dict(tm, compiles=spent["compiles"]))
                if rep == 0:  # where the first call's time went
                    row["first_call_timeline"] = spent
                assert np.asarray(batch.lengths).tolist() == lengths.tolist(), "the rows did not stop at their lengths"
                calls[-1]["loop_s"] = np.asarray(batch.segment_s).sum(axis=0).tolist()  # [host, segments]
                cold = calls[0]
                best = min(calls, key=lambda c: c["wall_s"])
                rollout_s = best["wall_s"]  # the full call: its programs compiled before
                generated = int(np.asarray(batch.lengths).sum())
                row.update(
                    rows=cold.get("rows"),
                    segments=int(batch.steps.shape[0]),
                    decode_steps=cold.get("decode_steps"),
                    # the plan the calls ran (a per-bucket benchmark times its own bucket's plan)
                    buckets=cold.get("buckets"),
                    segment_steps=cold.get("segment_steps"),
                    dense_weights=cold.get("dense_names"),
                    wgmma_weights=cold.get("wgmma_names"),
                    warm_compiles=sum(c["compiles"] for c in calls[1:]),
                    first_call_s=cold["wall_s"] + cold["prefill_s"],  # the one-token call compiled
                    # the programs compile (concurrently) in the cold one-token call
                    compile_s=cold["prefill_s"] - min(c["prefill_s"] for c in calls[1:]) if len(calls) > 1 else None,
                    programs_compiled=cold["compiles"],
                    rollout_s=rollout_s,
                    warm_calls=len(calls) - 1,
                    prefill_s=calls[-1].get("prefill_s"),
                    decode_s=calls[-1].get("decode_s"),
                    generated_tokens=generated,
                    tokens_per_s=generated / rollout_s,
                    # the fastest call's decode loop: host work between segments, and the segments
                    loop_host_s=best["loop_s"][0],
                    loop_device_s=best["loop_s"][1],
                    peak_bytes=peak_bytes(),
                    # the engine's estimate (what it sized its rows with) + the resident weights
                    estimated_peak_bytes=out["weight_bytes"] + cold["estimated_bytes"],
                )
                _save_partial(args, out)
        except Exception as e:  # noqa: BLE001 (report and go on with the next variant)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["errors"].append(traceback.format_exc()[-3000:])
        print(json.dumps(row), flush=True)
        _save_partial(args, out)
    return out


def gsm8k_torch_worker(args) -> dict:
    """transformers' generate on the same prompts and lengths: bf16, static cache (torch.compile
    on CUDA), sampling at T = 1, EOS forced at each row's drawn length and banned before it."""
    import torch
    import transformers

    from benchmarks import common
    from qerl_jax.models.qwen2 import ModelConfig  # noqa: PLC0415

    run, ids_np, lengths = gsm8k_inputs(args)
    cfg_dict = model_dict(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"format": "transformers", "rows": [], "errors": [], "versions": {"transformers": transformers.__version__}}
    t = time.perf_counter()
    model = common.hf_model(ModelConfig(**cfg_dict), device=device, use_cache=True, eos_token_id=EOS_ID).eval()
    out["build_s"] = time.perf_counter() - t
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor(ids_np, dtype=torch.long, device=device)
    target = torch.tensor(lengths, dtype=torch.long, device=device)

    class ForceEosAtLength(transformers.LogitsProcessor):
        """Row r emits EOS as its token number lengths[r] (and not before)."""

        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - ids.shape[1]  # tokens generated so far
            at_end = (target - 1 == made)[:, None]
            eos = torch.zeros_like(scores, dtype=torch.bool)
            eos[:, EOS_ID] = True
            scores = scores.masked_fill(~at_end & eos, float("-inf"))
            return scores.masked_fill(at_end & ~eos, float("-inf"))

    def generate(new_tokens):
        cache = transformers.StaticCache(config=model.config, max_cache_len=run["prompt_len"] + run["max_new"])
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=run["group"],
                past_key_values=cache,
                pad_token_id=0,
                eos_token_id=EOS_ID,
                logits_processor=transformers.LogitsProcessorList([ForceEosAtLength()]),
            )

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, res

    row = {"format": "transformers", "backend": "torch.compile-static-cache" if device == "cuda" else "torch-eager"}
    row["variant"] = "static batch"
    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row["compile_s"], _ = timed(lambda: generate(3))  # warm-up: compiles the decode step
        # A static batch decodes every row until the longest stops, at a constant cost per step
        # (the static cache's full length is attended): an estimate from 64 steps, saved before
        # the full rollout in case that outlasts the worker's time limit.
        first, _ = timed(lambda: generate(1))
        sixty_five, _ = timed(lambda: generate(65))
        step_s = (sixty_five - first) / 64
        row.update(decode_step_s=step_s, estimated_rollout_s=first + (int(lengths.max()) - 1) * step_s)
        _save_partial(args, {**out, "rows": [*out["rows"], dict(row, variant="static batch, estimated")]})
        wall, res = timed(lambda: generate(run["max_new"]))
        made = res[:, ids.shape[1] :]
        got = ((made == EOS_ID).int().argmax(dim=1) + 1).cpu().numpy()
        assert got.tolist() == lengths.tolist(), "the rows did not stop at their lengths"
        row.update(
            rows=len(lengths),
            first_call_s=row["compile_s"] + wall,
            rollout_s=wall,
            generated_tokens=int(lengths.sum()),
            tokens_per_s=float(lengths.sum()) / wall,
            peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        )
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["errors"].append(traceback.format_exc()[-3000:])
    print(json.dumps(row), flush=True)
    out["rows"].append(row)
    _save_partial(args, out)
    return out


def gsm8k_report(results: list[dict], args) -> dict:
    import numpy as np  # noqa: PLC0415

    run, _, lengths = gsm8k_inputs(args)
    rows = [r for res in results for r in res.get("rows", [])]
    header = (
        f"{'engine':<42}{'rows':>6}{'first call s':>13}{'compile s':>10}{'rollout s':>10}{'tokens/s':>10}"
        f"{'peak GB':>9}{'est. GB':>9}"
    )
    lines = [header, "-" * len(header)]
    gb = lambda x: f"{x / 1e9:.1f}" if x else "-"  # noqa: E731
    for r in rows:
        name = f"{r['format']} {r.get('backend', '')} {r.get('variant', '')}" + (
            f" [{r['attention']} attn]" if r.get("attention") else ""
        )
        if "error" in r:
            lines.append(f"{name:<42}  ERROR {r['error'][:90]}")
            continue
        if "rollout_s" not in r:  # the full rollout outlasted the worker: its estimate from 64 steps
            lines.append(f"{name:<42}{'-':>6}{'-':>13}{r['compile_s']:>10.1f}{r['estimated_rollout_s']:>10.2f}")
            continue
        lines.append(
            f"{name:<42}{r.get('rows') or '-':>6}{r['first_call_s']:>13.1f}{r.get('compile_s') or 0.0:>10.1f}"
            f"{r['rollout_s']:>10.2f}{r['tokens_per_s']:>10.0f}{gb(r.get('peak_bytes')):>9}"
            f"{gb(r.get('estimated_peak_bytes')):>9}"
        )

    def find(fmt, variant, backend=None):
        return next(
            (
                r
                for r in rows
                if r["format"] == fmt
                and r.get("variant") == variant
                and backend in (None, r.get("backend"))
                and "error" not in r
            ),
            None,
        )

    nv, bf, hf = find("nvfp4", "continuous", "pallas"), find("bf16", "continuous"), find("transformers", "static batch")
    ratios = {}
    for label, a, b in (
        ("NVFP4 / bf16 (continuous)", nv, bf),
        ("NVFP4 without its kernels (bf16 copies) / bf16 (continuous)", find("nvfp4", "continuous", "xla"), bf),
        ("NVFP4 / transformers", nv, hf),
        ("bf16 / transformers", bf, hf),
    ):
        if a and b:
            ratios[label] = b["rollout_s"] / a["rollout_s"]
    estimated = find("transformers", "static batch, estimated")
    if nv and estimated and not hf:
        ratios["NVFP4 / transformers (its time estimated from 64 steps)"] = (
            estimated["estimated_rollout_s"] / nv["rollout_s"]
        )
    table = "\n".join(lines)
    print(table)
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    stats = dict(
        sequences=len(lengths),
        generated_tokens=int(lengths.sum()),
        median=float(np.median(lengths)),
        mean=float(lengths.mean()),
        at_cap=float((lengths == run["max_new"]).mean()),
    )
    print(f"  lengths: {stats}")
    return {"workload": "gsm8k", "run": {**run, "tiny": args.tiny, "model": args.model}, "lengths": stats, "rows": rows,
            "ratios": ratios, "table": table, "workers": results}  # fmt: skip


# ----------------------------------------------------------------------------- report


def physical_limit(cfg: dict, row: dict, weight_bytes: int, ceilings: dict, run: dict) -> dict:
    """Lower bound of one decode step: stream the weights (all but the embedding table) and the
    whole static KV cache once, or do the matmul FLOPs at the measured peak, whichever is slower."""
    b = row["batch"]
    slots = run["prompt_len"] + run["new_tokens"]
    kv = 2 * cfg["num_hidden_layers"] * b * slots * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    embed = cfg["vocab_size"] * cfg["hidden_size"] * 2
    read = weight_bytes - embed + kv
    params = sum(n * k for n, k in (f(cfg) for f in PROJ_SHAPES.values())) * cfg["num_hidden_layers"]
    params += cfg["vocab_size"] * cfg["hidden_size"]
    mem_s = read / ceilings["copy_bytes_per_s"]
    flop_s = 2 * params * b / ceilings["matmul_flops_per_s"]
    step = max(mem_s, flop_s)
    return {
        "kv_bytes": kv,
        "limit_step_s": step,
        "limit_tokens_per_s": b / step,
        "bound": "memory" if mem_s >= flop_s else "compute",
    }


def launch_census(args, formats: list[str], timeout: float) -> dict:
    """Kernel launches per decode step of the run's bf16 and NVFP4 rows, counted on the CPU by
    `devtools/hlo_census.py` in a subprocess (XLA's GPU compiler for an H100, no device: needs
    jax's CUDA plugin, which a GPU machine has). {"rows": [...]} as the census writes them, or
    {"error": why}."""
    run = run_config(args)
    census_formats = [f for f in ("bf16", "nvfp4") if f in formats]
    if not census_formats:
        return {"error": "no bf16 or nvfp4 rows"}
    from qerl_jax.rollout import new_tokens_bucket, prompt_bucket  # noqa: PLC0415

    out = f"{args.out}.census.part"
    cmd = [
        sys.executable, "-m", "benchmarks.devtools.hlo_census",
        "--size", "tiny" if args.tiny else args.model,
        "--formats", ",".join(census_formats),
        "--batches", ",".join(str(p * g) for p, g in run["batches"]),
        "--prompt-len", str(prompt_bucket(run["prompt_len"])),
        "--new-slots", str(new_tokens_bucket(run["new_tokens"])),
        "--lora-rank", str(args.lora_rank),
        "--out", out,
    ]  # fmt: skip
    env = with_repo_on_path({**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the census ran past {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": f"the census failed: {lines[-1] if lines else proc.returncode}"}
    with open(out) as f:
        census = json.load(f)
    os.remove(out)
    return census


def attach_launches(rows: list[dict], census: dict) -> None:
    """Sets each row's `launches_per_step` and `launches_by_kind` from the census: its bf16 rows are
    those of backend "xla", its NVFP4 rows those of "pallas" (the backends `generate` runs them on)."""
    backend = {"bf16": "xla", "nvfp4": "pallas"}
    counted = {(c["format"], c["rows"]): c for c in census.get("rows", [])}
    for row in rows:
        c = counted.get((row.get("format"), row.get("batch")))
        if c is not None and row.get("backend") == backend.get(row["format"]):
            row["launches_per_step"] = c["launches"]
            row["launches_by_kind"] = c["by_kind"]


def report(results: list[dict], args, census: dict | None = None) -> dict:
    run = run_config(args)
    cfg = model_dict(args)
    ceilings = next((r["device_ceilings"] for r in results if "device_ceilings" in r), None)
    rows = []
    weights = {r["format"]: r["weight_bytes"] for r in results if r.get("weight_bytes")}
    lin = {r["format"]: r["linear_weight_bytes"] for r in results if r.get("linear_weight_bytes")}
    for res in results:
        for row in res.get("rows", []):
            if ceilings and "decode_step_s" in row and res.get("weight_bytes"):
                row.update(physical_limit(cfg, row, res["weight_bytes"], ceilings, run))
                row["fraction_of_limit"] = row["limit_step_s"] / row["decode_step_s"]
            row["weight_bytes"] = res.get("weight_bytes")
            rows.append(row)
    attach_launches(rows, census or {})

    def find(fmt, backend_prefix, batch):
        for r in rows:
            same = (r["format"], r["batch"]) == (fmt, batch) and r["backend"].startswith(backend_prefix)
            if same and "e2e_tokens_per_s" in r:
                return r
        return None

    targets = {}
    for _, group_rows in [(b, [r for r in rows if r["batch"] == b]) for b in sorted({r["batch"] for r in rows})]:
        b = group_rows[0]["batch"]
        nv = find("nvfp4", "pallas", b) or find("nvfp4", "xla", b)
        bf = find("bf16", "xla", b)
        hf = find("transformers", "torch", b)
        if nv and bf:
            targets[f"B={b} nvfp4/bf16 (e2e)"] = nv["e2e_tokens_per_s"] / bf["e2e_tokens_per_s"]
            targets[f"B={b} nvfp4/bf16 (decode)"] = nv["decode_tokens_per_s"] / bf["decode_tokens_per_s"]
        if nv and hf:
            targets[f"B={b} nvfp4/transformers (e2e)"] = nv["e2e_tokens_per_s"] / hf["e2e_tokens_per_s"]
        if bf and bf.get("ttft_no_sharing_s"):
            targets[f"B={b} bf16 prefill speed-up from group sharing"] = bf["ttft_no_sharing_s"] / bf["ttft_s"]
        if nv and nv.get("ttft_no_sharing_s"):
            targets[f"B={b} nvfp4 prefill speed-up from group sharing"] = nv["ttft_no_sharing_s"] / nv["ttft_s"]
    if weights.get("nvfp4") and weights.get("bf16"):
        targets["nvfp4 weight bytes / bf16 (whole policy)"] = weights["nvfp4"] / weights["bf16"]
        targets["nvfp4 weight bytes / bf16 (linears only)"] = lin["nvfp4"] / lin["bf16"]

    for r in rows:
        if r.get("decode_step_s_whole_norms"):  # --compare-norm-parts
            whole = r["decode_step_s_whole_norms"]
            targets[f"B={r['batch']} {r['format']} step with norms whole / in parts"] = whole / r["decode_step_s"]
    order = {w: i for i, w in enumerate(WORKER_ORDER)}
    rows.sort(key=lambda r: (r["batch"], order.get(f"{r['format']}:{r['backend']}", order["transformers"])))
    header = (
        f"{'format':<13}{'backend':<26}{'B':>5}{'ttft ms':>10}{'step ms':>9}{'dec tok/s':>11}{'e2e tok/s':>11}"
        f"{'limit tok/s':>12}{'of limit':>9}{'weights GB':>11}{'peak GB':>9}{'launches':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['format']:<13}{r['backend']:<26}{r['batch']:>5}  ERROR {r['error'][:80]}")
            continue
        gb = lambda x: f"{x / 1e9:.2f}" if x else "-"  # noqa: E731
        lines.append(
            f"{r['format']:<13}{r['backend']:<26}{r['batch']:>5}"
            f"{r['ttft_s'] * 1e3:>10.1f}{r['decode_step_s'] * 1e3:>9.2f}"
            f"{r['decode_tokens_per_s']:>11.0f}{r['e2e_tokens_per_s']:>11.0f}"
            f"{r.get('limit_tokens_per_s', float('nan')):>12.0f}{r.get('fraction_of_limit', float('nan')):>9.2f}"
            f"{gb(r.get('weight_bytes')):>11}{gb(r.get('peak_bytes')):>9}{r.get('launches_per_step', '-'):>10}"
        )
    table = "\n".join(lines)
    print(table)
    for k, v in targets.items():
        print(f"  {k}: {v:.2f}")
    if census and "error" in census:
        print(f"  launches per step: none ({census['error']})")
    return {
        "run": {**run, "tiny": args.tiny, "model": cfg},
        "launch_census": {k: v for k, v in (census or {}).items() if k != "rows"},
        "device_ceilings": ceilings,
        "rows": rows,
        "ratios": targets,
        "table": table,
        "workers": results,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="rollout_bench.json")
    parser.add_argument("--tiny", action="store_true", help="tiny model and batches (CPU smoke test)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    parser.add_argument("--workload", choices=("decode", "gsm8k"), default="decode", help="see the module doc")
    parser.add_argument(
        "--reps", type=int, default=None, help="warm repetitions (default: decode 3 of each step count, gsm8k 0)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds; later variants are skipped (default: decode 290, gsm8k 330)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="the decode attention of every JAX row (auto: the Pallas kernel on a GPU when installed, else xla)",
    )
    parser.add_argument(
        "--compile-cache", default="", help="a directory for JAX's persistent compilation cache (the workers share it)"
    )
    parser.add_argument("--workers", default="", help="run only these workers, e.g. nvfp4:pallas (gsm8k) or bf16:xla")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-device", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-sharing-row", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--model", default="7B", help="the Qwen2.5 size whose shapes the random model has (0.5B ... 72B)"
    )
    parser.add_argument("--prompts", type=int, default=0, help="gsm8k workload: prompts per rollout (default 32)")
    parser.add_argument("--group", type=int, default=0, help="gsm8k workload: samples per prompt (default 8)")
    parser.add_argument("--max-new", type=int, default=0, help="gsm8k workload: the token cap (default 2048)")
    parser.add_argument("--batches", default="", help="prompts x group list, e.g. 1x1,2x8 (default: the issue's)")
    parser.add_argument(
        "--compare-wgmma", action="store_true", help="also time NVFP4 rows without the wgmma kernel (Triton)"
    )
    parser.add_argument(
        "--compare-unfused",
        action="store_true",
        help="also time wgmma rows with one kernel call per projection (no fused q/k/v, gate/up)",
    )
    parser.add_argument(
        "--compare-norm-parts",
        action="store_true",
        help="also time the 1-row rows with each norm whole (RolloutOptions.norm_parts=False)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="policies with a fresh LoRA adapter of this rank on every projection, as in RL (not the peer)",
    )
    args = parser.parse_args(argv)
    gsm8k = args.workload == "gsm8k"
    if args.reps is None and not gsm8k:
        args.reps = 3
    if args.deadline is None:
        args.deadline = 330.0 if gsm8k else 290.0

    if args.worker:
        if args.compile_cache:
            from qerl_jax.compile_cache import enable_compilation_cache  # noqa: PLC0415

            enable_compilation_cache(args.compile_cache)
        if gsm8k:
            res = gsm8k_torch_worker(args) if args.worker == "transformers" else None
            if res is None:
                variants = dict(GSM8K_WORKERS)[args.worker]
                res = gsm8k_jax_worker(args, *args.worker.split(":")[:2], variants)
        elif args.worker == "transformers":
            res = torch_worker(args)
        else:
            res = jax_worker(args, *args.worker.split(":"))
        _save_partial(args, res)
        return

    start = time.time()
    deadline_at = start + args.deadline
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; expected a subset of {FORMATS}")
    order = [w for w, _ in GSM8K_WORKERS] if gsm8k else WORKER_ORDER
    workers = [w for w in order if w.split(":")[0] in formats or (w == "transformers" and not args.no_peer)]
    if args.workers:
        unknown = set(args.workers.split(",")) - set(order)
        if unknown:
            parser.error(f"--workers: unknown {sorted(unknown)}; expected some of {list(order)}")
        workers = [w for w in workers if w in args.workers.split(",")]
    results = []
    for i, name in enumerate(workers):
        if time.time() > deadline_at:
            results.append({"format": name, "rows": [], "errors": [f"deadline reached before worker {name}"]})
            print(f"[{name}] skipped: deadline reached", flush=True)
            continue
        worker_out = f"{args.out}.{name.replace(':', '-')}.part"
        cmd = [
            sys.executable,
            "-m",
            __spec__.name,
            "--worker",
            name,
            "--worker-out",
            worker_out,
            *(["--reps", str(args.reps)] if args.reps is not None else []),
            "--deadline-at",
            str(deadline_at),
            "--workload",
            args.workload,
            "--attention",
            args.attention,
        ]
        if args.compile_cache:
            cmd += ["--compile-cache", args.compile_cache]
        if args.tiny:
            cmd.append("--tiny")
        if args.batches:
            cmd += ["--batches", args.batches]
        cmd += ["--model", args.model]
        for name in ("prompts", "group", "max_new"):
            if getattr(args, name):
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        if args.compare_wgmma:
            cmd.append("--compare-wgmma")
        if args.compare_unfused:
            cmd.append("--compare-unfused")
        if args.compare_norm_parts:
            cmd.append("--compare-norm-parts")
        if args.lora_rank:
            cmd += ["--lora-rank", str(args.lora_rank)]
        if i == 0 and not gsm8k:
            cmd.append("--measure-device")
        if name == "bf16:xla" and not gsm8k:
            cmd.append("--no-sharing-row")
        env = with_repo_on_path(dict(os.environ))
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
        t = time.time()
        print(f"== {name}", flush=True)
        try:
            # gsm8k: a worker may run minutes past the deadline (its rollouts), but all end by ~570 s.
            limit = start + 570.0 - time.time() if gsm8k else deadline_at - time.time() + 90
            proc = subprocess.run(cmd, env=env, timeout=max(30.0, limit))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "killed at its time limit"
        try:
            with open(worker_out) as f:
                res = json.load(f)
            os.remove(worker_out)
        except (OSError, json.JSONDecodeError):
            res = {"format": name, "rows": [], "errors": [f"worker exited ({code}) with no result"]}
        res["wall_s"] = time.time() - t
        results.append(res)
        for e in res.get("errors", []):
            print(f"[{name}] error: {e}", flush=True)
    if gsm8k:
        summary = gsm8k_report(results, args)
    else:  # the launch census compiles on the CPU: ~5-20 s a row
        census = launch_census(args, formats, timeout=max(60.0, deadline_at + 120 - time.time()))
        summary = report(results, args, census)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
