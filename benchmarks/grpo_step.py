"""One full GRPO step (rollout + reward + train) on a Qwen2.5-shaped random model, per base format.

    python -m benchmarks.grpo_step --out $OUT/grpo_step.json          # GPU: 7B
    python -m benchmarks.grpo_step --tiny --out /tmp/grpo_step.json   # CPU smoke test
    python -m benchmarks.grpo_step --workload gsm8k --out $OUT/grpo_gsm8k.json   # GPU, 7B
    python -m benchmarks.grpo_step --workload gsm8k --tiny --out /tmp/grpo_gsm8k.json
    python -m benchmarks.grpo_step --workload dapo --out $OUT/dapo.json   # GPU, 7B: benchmarks/dapo_step.py

--workload gsm8k: the recipe's step at 7B shapes with the rollout benchmark's seeded long-tailed
completion lengths (benchmarks/rollout.py `gsm8k_inputs`: EOS at each row's drawn length), per
base (nvfp4, bf16) the train phase twice: "padded" (every sequence in its own row, rows as wide as
the batch's longest sequence: the step's cost before packing) and "packed" (`rl.packing`, as the
training loop does). Each case records train_tokens_real (prompt + response tokens trained on)
and train_tokens_computed (slots the train forward computes, padding included).

For each base (bf16 LoRA, NF4, NVFP4) a child process builds the random model on the device
(benchmarks/common.py) and runs the training loop's own pieces: `rollout.generate`
(group sampling from shared prefills, fixed-length responses), the reward pool
(`reward_pool.RewardPool`; random models have no tokenizer, so each completion is scored as the
text of its token ids against a numeric answer, which exercises the same extraction and
math-verify path), group advantages and the jitted train step (LoRA, the recipe's flash attention
and remat choice, micro-batches). Each phase is compiled by a warm-up call first (the rollout
warm-up stops every row after one token, so it compiles the same programs), then timed once.
The format `peer` is transformers + PEFT (benchmarks/common.py): `generate` (sampling, its default
cache) then the same DAPO train step. The train phase's TFLOP/s use `common.train_flops` (printed).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from benchmarks import dapo_step

RESULT_PREFIX = "RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test)")
    p.add_argument("--model", default="7B")
    p.add_argument(
        "--formats",
        default="bf16,nvfp4,peer",
        help="bf16 | nvfp4 | mxfp4 | nf4 | peer, comma-separated; gsm8k: FORMAT:MODE sets model.fp8_matmul "
        "(auto | on | off; default auto)",
    )
    p.add_argument("--attention", default="flash", choices=("flash", "xla"))
    p.add_argument("--remat", default="auto", help="auto | full | proj | none (auto: the training loop's choice)")
    p.add_argument("--prompts", type=int, default=None, help="default: 8 (fixed), the recipe's 32 (gsm8k, dapo)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per child process")
    p.add_argument("--out", default=None)
    p.add_argument("--workload", default="fixed", choices=("fixed", "gsm8k", "dapo"), help="see the module doc")
    p.add_argument("--keep-rate", type=float, default=0.5, help="dapo: the share of groups drawn to vary")
    p.add_argument("--refill-rounds", type=int, default=2, help="dapo: rl.max_refill_rounds")
    p.add_argument("--layouts", default="padded,packed", help="gsm8k: the train layouts timed (padded, packed)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompts is None and args.workload == "fixed":
        args.prompts = 8
    if args.tiny:
        args.model, args.prompts, args.group, args.prompt_len, args.new_tokens = "tiny", 2, 4, 16, 16
        args.rank, args.micro_batch_size, args.logprob_chunk = 4, 4, 16
        if args.workload != "fixed":  # 16 sequences fill ~5 packed rows: a micro-batch of 4 would round to 8
            args.micro_batch_size = 1
    return args


def run_case(args, fmt: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import common, train_step
    from qerl_jax import lora, optim, reward_pool
    from qerl_jax.rl import losses, packing
    from qerl_jax.rl.step import TrainStep, init_train_state
    from qerl_jax.rollout.sampler import RolloutOptions, generate, to_train_batch
    from qerl_jax.rollout.sampling import SamplingConfig

    config = common.model_config(args.model)
    backend = common.backend_for(fmt)
    t0 = time.perf_counter()
    frozen = common.random_params(config, quant=fmt, seed=0)
    build_s = time.perf_counter() - t0
    lcfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    scale = lora.lora_scale(lcfg)
    optimizer = optim.make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    state = init_train_state(lora.init_lora(jax.random.key(1), config, lcfg), optimizer)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, config.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    policy = {**frozen, "lora": state.lora}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    warm = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, eos_ids=tuple(range(config.vocab_size)))
    remat, micro_batch_size = train_step.resolve_remat(
        config, fmt=fmt, backend=backend, attention=args.attention, remat=args.remat, args=args
    )
    row = {
        "format": fmt,
        "backend": backend,
        "attention": args.attention,
        "remat": remat,
        "micro_batch_size": micro_batch_size,
        "model": args.model,
        "build_s": build_s,
        "sequences": args.prompts * args.group,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }

    t0 = time.perf_counter()
    jax.block_until_ready(
        generate(
            config,
            policy,
            prompt_ids,
            prompt_mask,
            jax.random.key(2),
            warm,
            group_size=args.group,
            lora_scale=scale,
            options=RolloutOptions(backend=backend),
        ).tokens
    )
    row["rollout_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = generate(
        config,
        policy,
        prompt_ids,
        prompt_mask,
        jax.random.key(3),
        sampling,
        group_size=args.group,
        lora_scale=scale,
        options=RolloutOptions(backend=backend),
    )
    jax.block_until_ready(batch.tokens)
    row["rollout_s"] = time.perf_counter() - t0
    row["rollout_tokens_per_s"] = args.prompts * args.group * args.new_tokens / row["rollout_s"]

    tokens = np.asarray(batch.tokens)
    answers = [str(int(r[0]) % 100) for r in tokens]
    texts = [" ".join(map(str, r.tolist())) for r in tokens]
    with reward_pool.RewardPool() as pool:
        pool.score(texts[:2], answers[:2])  # workers up
        t0 = time.perf_counter()
        scores = pool.score(texts, answers)
        row["reward_s"] = time.perf_counter() - t0
    scores = scores + rng.uniform(0, 1, scores.shape).astype(np.float32)  # varied rewards: every group trains

    padded = {k: np.asarray(v) for k, v in to_train_batch(batch).items()}
    padded["advantages"] = np.asarray(losses.group_advantages(jnp.asarray(scores), args.group))
    # The training loop's layout: packed rows of prompt + new tokens (`rl.packing`).
    train_batch = packing.pack_batch(padded, padded["input_ids"].shape[1], rows_multiple=micro_batch_size or 1)
    step = TrainStep(
        config,
        losses.LossConfig(kind="dapo"),
        optimizer,
        lora_scale=scale,
        backend=backend,
        remat=remat,
        attention=args.attention,
        micro_batch_size=micro_batch_size,
        logprob_chunk=args.logprob_chunk,
    )
    t0 = time.perf_counter()
    state, m = step(state, {"base": frozen["base"], "norms": frozen["norms"]}, train_batch)
    jax.block_until_ready(m)
    row["train_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, m = step(state, {"base": frozen["base"], "norms": frozen["norms"]}, train_batch)
    jax.block_until_ready(m)
    row["train_s"] = time.perf_counter() - t0
    row["train_tokens_per_s"] = float(padded["attention_mask"].sum()) / row["train_s"]
    _train_flops(row, config, args)
    row["step_s"] = row["rollout_s"] + row["reward_s"] + row["train_s"]
    row["loss_finite"] = bool(np.isfinite(float(m["loss"])))
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30 or None
    row["weight_gib"] = common.tree_bytes(frozen) / 2**30
    return row


def run_gsm8k_case(args, case: str) -> dict:
    """The gsm8k workload (module doc) for one base: rollout with EOS at the drawn lengths, reward,
    then the train phase padded and packed (--layouts), each timed warm. case: a format, or
    "FORMAT:MODE" with MODE the FP8 matmuls' `model.fp8_matmul` (default auto)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import common
    from benchmarks import rollout as rollout_bench
    from qerl_jax import fp8, linear, lora, optim, reward_pool
    from qerl_jax.models.qwen2 import ModelConfig
    from qerl_jax.rl import losses, packing
    from qerl_jax.rl.step import TrainStep, init_train_state
    from qerl_jax.rollout.sampler import RolloutOptions, generate, to_train_batch
    from qerl_jax.rollout.sampling import SamplingConfig

    fmt, _, fp8_mode = case.partition(":")
    fp8_mode = fp8_mode or "auto"
    run, prompt_ids, lengths = rollout_bench.gsm8k_inputs(args)
    config = ModelConfig(**(rollout_bench.TINY if args.tiny else rollout_bench.QWEN25_7B))
    backend = common.backend_for(fmt)
    frozen = common.random_params(config, quant=fmt, seed=0)
    lcfg = lora.LoraConfig(rank=run["lora_rank"], alpha=2.0 * run["lora_rank"])
    scale = lora.lora_scale(lcfg)
    optimizer = optim.make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    state = init_train_state(lora.init_lora(jax.random.key(1), config, lcfg), optimizer)
    n = run["prompts"] * run["group"]
    mb = args.micro_batch_size
    row = {"format": case, "backend": backend, "model": "tiny" if args.tiny else "7B", "sequences": n,
           "prompt_len": run["prompt_len"], "max_new_tokens": run["max_new"], "micro_batch_size": mb,
           "mean_completion": float(lengths.mean())}  # fmt: skip
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=run["max_new"], ignore_eos=True)
    kw = dict(group_size=run["group"], lora_scale=scale, max_new_tokens_per_seq=lengths)
    kw["options"] = RolloutOptions(backend=backend, fp8_matmul=fp8_mode)
    row["fp8_matmul"] = fp8.enabled(fp8_mode, fmt != "bf16")
    policy = {**frozen, "lora": state.lora}
    mask = np.ones_like(prompt_ids)
    jax.block_until_ready(generate(config, policy, prompt_ids, mask, jax.random.key(2), sampling, **kw).tokens)
    t0 = time.perf_counter()
    batch = generate(config, policy, prompt_ids, mask, jax.random.key(3), sampling, **kw)
    jax.block_until_ready(batch.tokens)
    row["rollout_s"] = time.perf_counter() - t0
    tokens, got = np.asarray(batch.tokens), np.asarray(batch.lengths)
    answers = [str(int(r[0]) % 100) for r in tokens]
    texts = [" ".join(map(str, r[:k].tolist())) for r, k in zip(tokens, got)]
    with reward_pool.RewardPool() as pool:
        pool.score(texts[:2], answers[:2])
        t0 = time.perf_counter()
        scores = pool.score(texts, answers)
        row["reward_s"] = time.perf_counter() - t0
    scores = scores + np.random.default_rng(0).uniform(0, 1, scores.shape).astype(np.float32)
    padded = {k: np.asarray(v) for k, v in to_train_batch(batch).items()}
    padded["advantages"] = np.asarray(losses.group_advantages(jnp.asarray(scores), run["group"]))
    seq_len = padded["attention_mask"].sum(axis=1)
    layouts = {  # today's cost: one sequence per row at the longest one's width; vs first-fit packing
        "padded": lambda: packing.pack_batch(
            padded, int(seq_len.max()), rows_multiple=mb, rows=[[i] for i in range(n)]
        ),
        "packed": lambda: packing.pack_batch(padded, run["prompt_len"] + run["max_new"], rows_multiple=mb),
    }
    layouts = {name: layouts[name]() for name in args.layouts.split(",")}
    step = TrainStep(
        config, losses.LossConfig(kind="dapo"), optimizer, lora_scale=scale, backend=backend,
        remat=args.remat if args.remat != "auto" else "full", attention=args.attention,
        micro_batch_size=mb, logprob_chunk=args.logprob_chunk,
        compiler_options=fp8.TRAIN_COMPILER_OPTIONS if row["fp8_matmul"] else None,
    )  # fmt: skip
    f = {"base": frozen["base"], "norms": frozen["norms"]}
    if row["fp8_matmul"]:  # the train step's FP8 copies, made once (as train.py does)
        t0 = time.perf_counter()
        f = jax.block_until_ready(linear.fp8_train_base(f))
        row["fp8_copies_s"], row["fp8_copy_gib"] = time.perf_counter() - t0, fp8.train_copy_bytes(frozen) / 2**30
    row["cases"] = {}
    for name, train_batch in layouts.items():
        counts = packing.token_counts(train_batch)
        state, m, train_s = common.timed_train(step, state, f, train_batch)
        row["cases"][name] = {
            "train_tokens_real": counts["real"],
            "train_tokens_computed": counts["computed"],
            "computed_over_real": counts["computed"] / counts["real"],
            "rows": int(train_batch["input_ids"].shape[0]),
            "row_len": int(train_batch["input_ids"].shape[1]),
            "train_s": train_s,
            "step_s": row["rollout_s"] + row["reward_s"] + train_s,
            "loss": float(m["loss"]),
        }
    if len(row["cases"]) == 2:
        pad, pk = row["cases"]["padded"], row["cases"]["packed"]
        row["packed_step_over_padded"] = pk["step_s"] / pad["step_s"]
        row["packed_train_over_padded"] = pk["train_s"] / pad["train_s"]
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30 or None
    return row


def _write(args, rows: list[dict]) -> None:
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


def _train_flops(row: dict, config, args) -> None:
    from benchmarks import common

    seq = args.prompt_len + args.new_tokens
    flops = common.train_flops(config, tokens=args.prompts * args.group * seq, seq_len=seq, lora_rank=args.rank)
    row["train_tflop"] = flops["step"] / 1e12
    row["train_tflops"] = row["train_tflop"] / row["train_s"]


def run_peer_case(args) -> dict:
    """transformers + PEFT: sampled `generate` (its default cache) of the same rollout, then the same
    DAPO train step (benchmarks/common.py)."""
    import numpy as np
    import torch

    from benchmarks import common

    config = common.model_config(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    model = common.peer_model(config, lora_rank=args.rank, device=device)
    row = {"format": "peer", "backend": "transformers+peft", "model": args.model, "build_s": time.perf_counter() - t0}
    row.update(sequences=args.prompts * args.group, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(0, config.vocab_size, (args.prompts, args.prompt_len)), device=device)

    def rollout(new_tokens):
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=args.group,
                pad_token_id=0,
                use_cache=True,
            )
        model.train()
        return out

    rollout(2)  # warm-up
    sync()
    t0 = time.perf_counter()
    tokens = rollout(args.new_tokens)
    sync()
    row["rollout_s"] = time.perf_counter() - t0
    row["rollout_tokens_per_s"] = args.prompts * args.group * args.new_tokens / row["rollout_s"]
    seq = args.prompt_len + args.new_tokens
    batch = common.random_rl_batch(
        config, batch=args.prompts * args.group, seq_len=seq, prompt_len=args.prompt_len
    )
    batch["input_ids"] = tokens.cpu().numpy().astype(np.int32)
    batch["attention_mask"] = np.ones_like(batch["input_ids"])
    batch["response_mask"] = np.zeros(batch["input_ids"].shape, np.float32)
    batch["response_mask"][:, args.prompt_len :] = 1
    row["reward_s"] = 0.0  # the same reward pool as ours; not re-timed here
    timed = common.time_peer_train(model, batch, micro_batch_size=args.micro_batch_size, steps=1)
    row["train_s"] = timed["step_s"]
    row["train_tokens_per_s"] = float(batch["attention_mask"].sum()) / row["train_s"]
    _train_flops(row, config, args)
    row["step_s"] = row["rollout_s"] + row["train_s"]
    row["peak_gib"] = (timed["peak_bytes_in_use"] or 0) / 2**30 or None
    row["loss_finite"] = bool(np.isfinite(timed["loss"]))
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        try:
            if args.workload == "gsm8k":
                row = run_gsm8k_case(args, args.case)
            elif args.workload == "dapo":
                row = dapo_step.run_dapo_case(args, args.case)
            else:
                row = run_peer_case(args) if args.case == "peer" else run_case(args, args.case)
        except Exception as e:  # reported, not fatal: the other formats still run
            row = {
                "format": args.case,
                "error": f"{type(e).__name__}: {e}"[:2000],
                "trace": traceback.format_exc()[-3000:],
            }
        print(RESULT_PREFIX + json.dumps(row), flush=True)
        return
    rows = []
    formats = args.formats
    if args.workload != "fixed" and formats == "bf16,nvfp4,peer":
        formats = "nvfp4,bf16"
    for fmt in formats.split(","):
        cmd = [
            sys.executable,
            "-m",
            __spec__.name,
            "--case",
            fmt,
            "--model",
            args.model,
            *(["--prompts", str(args.prompts)] if args.prompts else []),
            "--group",
            str(args.group),
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--rank",
            str(args.rank),
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--logprob-chunk",
            str(args.logprob_chunk),
            "--attention",
            args.attention,
            "--remat",
            args.remat,
            "--workload",
            args.workload,
            "--keep-rate",
            str(args.keep_rate),
            "--refill-rounds",
            str(args.refill_rounds),
            "--layouts",
            args.layouts,
            *(["--tiny"] if args.tiny else []),
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ})
            lines = [l for l in out.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
            rows.append(
                json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else {"format": fmt, "error": out.stderr[-2000:]}
            )
        except subprocess.TimeoutExpired:
            rows.append({"format": fmt, "error": f"timed out after {args.timeout} s"})
    if args.workload == "gsm8k":
        report_gsm8k(rows, args)
        return
    if args.workload == "dapo":
        dapo_step.report_dapo(rows)
        _write(args, rows)
        return
    base = next((r for r in rows if r.get("format") == "bf16" and "step_s" in r), None)
    print(
        f"\nGRPO step, {args.model}-shaped random model, {args.prompts} prompts x {args.group} = "
        f"{args.prompts * args.group} sequences, {args.prompt_len} + {args.new_tokens} tokens"
    )
    if any("train_tflop" in r for r in rows):
        tflop = next(r["train_tflop"] for r in rows if "train_tflop" in r)
        print(f"train FLOPs by formula (benchmarks/common.py train_flops): {tflop:.0f} TFLOP per train phase")
    print(
        f"{'base':8} {'backend':17} {'remat':5} {'rollout s':>10} {'reward s':>9} {'train s':>8} {'train TFLOP/s':>13} "
        f"{'step s':>8} {'vs bf16':>8} {'peak GiB':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['format']:8} error: {r['error'][:200]}")
            continue
        speedup = base["step_s"] / r["step_s"] if base else float("nan")
        print(
            f"{r['format']:8} {r['backend']:17} {r.get('remat', 'full'):5} {r['rollout_s']:10.2f} {r['reward_s']:9.2f} "
            f"{r['train_s']:8.2f} {r.get('train_tflops', float('nan')):13.1f} "
            f"{r['step_s']:8.2f} {speedup:7.2f}x {r['peak_gib'] or float('nan'):9.1f}"
        )
    _write(args, rows)


def report_gsm8k(rows: list[dict], args) -> None:
    print("\nGRPO step, gsm8k workload (long-tailed completions): train phase padded vs packed")
    print(f"{'base':6} {'case':7} {'real tok':>9} {'computed':>9} {'x real':>7} {'train s':>8} {'step s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['format']:6} error: {r['error'][:300]}")
            continue
        for name, c in r["cases"].items():
            print(
                f"{r['format']:6} {name:7} {c['train_tokens_real']:9d} {c['train_tokens_computed']:9d} "
                f"{c['computed_over_real']:7.2f} {c['train_s']:8.2f} {c['step_s']:8.2f}"
            )
        if "packed_step_over_padded" in r:
            print(f"{r['format']:6} packed step / padded step: {r['packed_step_over_padded']:.3f}")
    packed = {r["format"]: r["cases"]["packed"] for r in rows if "packed" in r.get("cases", {})}
    if "bf16" in packed:
        for name, c in packed.items():
            bf = packed["bf16"]
            print(
                f"{name:12} packed: rollout {next(r['rollout_s'] for r in rows if r['format'] == name):6.2f} s, "
                f"train {c['train_s']:6.2f} s, step {c['step_s']:6.2f} s; vs bf16: step "
                f"{bf['step_s'] / c['step_s']:.2f}x, train {bf['train_s'] / c['train_s']:.2f}x"
            )
    _write(args, rows)


if __name__ == "__main__":
    main()
