"""Data-parallel scaling of the GRPO step users run: whole long-tailed rollouts + the train step.

    python -m benchmarks.data_parallel --out $OUT/dp.json                 # all local GPUs: 1, 2, 4, ...
    python -m benchmarks.data_parallel --max-devices 1 --model-shards 2 --quant bf16  # tensor parallel
    python -m benchmarks.data_parallel --max-devices 0 --model-shards 2 --model 32B --quant bf16  # tp only
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python -m benchmarks.data_parallel --tiny --out /tmp/dp.json      # CPU smoke test

A Qwen2.5-shaped random NVFP4 policy with LoRA (benchmarks/common.py) on the recipe's workload
(prompts x group sequences, continuous batching with refills and compaction) with completion
lengths drawn like the real run's: log-normal with median --median, a fraction --cap-fraction of
them at --max-new. The default 0.1% is what the real 1.5B recipe showed (`configs/gsm8k.py`, 4 x
H200, 2026-11-27, `725b5ce`: 0-0.3% of a step's completions at the 2048 cap, mean 330):
there a step's longest completion grows with its size (~1000 tokens at 256 sequences, 1874 at
1024), which is what bounds the weak scaling. With 5% at the cap (the rollout benchmark's
workload) every shard has rows to the cap whatever its size, and the weak scaling looked ideal
(4.12x at N = 4 where the real run gave 2.79x). For each device count n in
1, 2, 4, ... (up to the local GPUs), on a ("data", "model") = (n, 1) mesh, one process:

- `shards` (the run's path, `qerl_jax.rollout.data_parallel`): each device decodes its block of
  the prompts with its own scheduler; then the packed DAPO train step with the batch split over
  "data";
- `one call` (the smallest n > 1; the path before, kept as the baseline): one `generate` call whose rows are
  sharded over "data" (`RolloutOptions(batch_sharding=...)`);
- `tp` (with --model-shards M > 1): the same batch on a (1, M) mesh, the base tensor parallel over
  "model" (the Pallas kernels run per device), against one device. With --max-devices 0 it is the
  only row (a model whose weights do not fit one device, e.g. 32B bf16 on an 80 GB H100): the
  weights are made in their tensor-parallel sharding (`common.random_params(..., mesh=...)`) and
  the ratios are against the first row, here the tp row itself (1.0).

Strong scaling: the same batch on n devices; weak scaling: n times the prompts. Each rollout is
the second of two calls (the first compiles), the train step likewise. The step = rollout +
train. Reported: a table and a JSON of seconds, speed-ups and completions per second.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks import common
from benchmarks.rollout import completion_lengths
from qerl_jax import compile_cache, sharding
from qerl_jax.lora import LoraConfig, init_lora, lora_scale, with_lora
from qerl_jax.optim import make_optimizer
from qerl_jax.rl import packing
from qerl_jax.rl import step as rl_step
from qerl_jax.rl.losses import LossConfig
from qerl_jax.rollout import RolloutOptions, SamplingConfig, generate, to_train_batch
from qerl_jax.rollout.data_parallel import ShardPlan, generate_data_parallel


def _timed(fn):
    """(result, seconds) of the second of two calls (the first compiles)."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def _inputs(config, prompts: int, args):
    rng = np.random.default_rng(1)
    ids = rng.integers(1, config.vocab_size, (prompts, args.prompt_len)).astype(np.int32)
    lengths = completion_lengths(
        prompts * args.group, median=args.median, max_new=args.max_new, cap_fraction=args.cap_fraction
    )
    return ids, np.ones_like(ids), lengths


def _train_batch(out, args) -> dict[str, np.ndarray]:
    batch = {k: np.asarray(v) for k, v in to_train_batch(out).items()}
    batch["advantages"] = np.random.default_rng(2).standard_normal(batch["input_ids"].shape[0]).astype(np.float32)
    return packing.pack_batch(batch, args.prompt_len + args.max_new, rows_multiple=args.micro_batch_size)


def measure(config, params, lora, n: int, prompts: int, path: str, args, model: int = 1) -> dict:
    """Rollout, train and step seconds of `prompts` x group sequences on the first n x model devices
    (a (n, model) mesh)."""
    mesh = sharding.make_mesh(n, model, devices=jax.devices()[: n * model])
    policy = sharding.shard_params(with_lora(params, lora), mesh, "tp")
    frozen = sharding.shard_params(params, mesh, "tp")
    ids, mask, lengths = _inputs(config, prompts, args)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new, ignore_eos=True)
    backend = "xla" if jax.default_backend() == "cpu" else "pallas"
    kw = dict(group_size=args.group, lora_scale=lora_scale(args.lcfg))
    if path in ("shards", "tp"):
        run = lambda: generate_data_parallel(  # noqa: E731
            config, policy, ids, mask, jax.random.key(3), sampling, mesh=mesh, options=RolloutOptions(backend=backend),
            plan=ShardPlan(max_new_tokens_per_seq=lengths), **kw,
        )  # fmt: skip
    else:
        opts = RolloutOptions(backend=backend, batch_sharding=sharding.data_sharding(mesh))
        run = lambda: generate(  # noqa: E731
            config, policy, ids, mask, jax.random.key(3), sampling, options=opts, max_new_tokens_per_seq=lengths, **kw
        )
    out, roll_s = _timed(run)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    step = rl_step.TrainStep(
        config, LossConfig(kind="dapo"), optimizer, lora_scale=lora_scale(args.lcfg), backend=backend, remat=True,
        micro_batch_size=args.micro_batch_size, logprob_chunk=args.logprob_chunk,
    )  # fmt: skip
    batch = sharding.shard_batch(_train_batch(out, args), mesh)
    lora_n = sharding.shard_like_lora(lora, mesh, "tp")
    (_, metrics), train_s = _timed(lambda: step(rl_step.init_train_state(lora_n, optimizer), frozen, batch))
    seqs = prompts * args.group
    res = dict(
        devices=n * model, path=path, prompts=prompts, sequences=seqs, rollout_s=roll_s, train_s=train_s,
        step_s=roll_s + train_s, completions_per_s=seqs / (roll_s + train_s), loss=float(metrics["loss"]),
        tokens=np.asarray(out.tokens), lengths=int(lengths.sum()), longest=int(lengths.max()),
    )  # fmt: skip
    print(json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
    return res


def run(args) -> dict:
    n_max = len(jax.devices())
    counts = [n for n in (1, 2, 4, 8) if n <= n_max and n <= args.max_devices]
    tp = 1 < args.model_shards <= n_max
    config = common.model_config("tiny" if args.tiny else args.model)
    # tp only: made in the tp row's sharding, no device holds a whole weight
    mesh = sharding.make_mesh(1, args.model_shards, devices=jax.devices()[: args.model_shards]) if not counts else None
    params = common.random_params(config, quant=args.quant, seed=0, mesh=mesh)
    args.lcfg = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    lora = init_lora(jax.random.key(1), config, args.lcfg)
    lora = jax.tree.map(lambda x: x + 1e-3 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), lora)
    rows = []
    for n in counts:
        rows.append(measure(config, params, lora, n, args.prompts, "shards", args))  # strong scaling
        if n > 1:
            rows.append(measure(config, params, lora, n, args.prompts * n, "shards", args))  # weak scaling
            if not args.skip_one_call and n == counts[1]:
                rows.append(measure(config, params, lora, n, args.prompts, "one call", args))
    if tp:
        rows.append(measure(config, params, lora, 1, args.prompts, "tp", args, model=args.model_shards))
    one = rows[0]  # the ratios' baseline: one device's row, or the tp row alone (--max-devices 0)
    for r in rows:
        r["step_speedup"] = one["step_s"] / r["step_s"] if r["prompts"] == one["prompts"] else None
        r["throughput_vs_1"] = r["completions_per_s"] / one["completions_per_s"]
        r["tokens_equal_1"] = bool(r["prompts"] == one["prompts"] and np.array_equal(r["tokens"], one["tokens"]))
    for r in rows:
        del r["tokens"]
    return {
        "model": "tiny" if args.tiny else args.model, "quant": args.quant, "device_kind": jax.devices()[0].device_kind,
        "group": args.group, "prompt_len": args.prompt_len, "max_new": args.max_new, "median": args.median,
        "cap_fraction": args.cap_fraction, "baseline": f"{one['path']} on {one['devices']} devices",
        "rows": rows,
    }  # fmt: skip


def table(report: dict) -> str:
    head = f"{'GPUs':>4} {'path':9} {'prompts':>7} {'longest':>7} {'rollout s':>9} {'train s':>8} {'step s':>7} {'speed-up':>8} {'compl/s':>8} {'x 1 GPU':>7}"
    lines = [f"{report['model']} {report['quant']} on {report['device_kind']}, group {report['group']}, up to "
             f"{report['max_new']} new tokens (median {report['median']}, {report['cap_fraction']:.2%} at the cap); "
             f"ratios against {report['baseline']}", head]  # fmt: skip
    for r in report["rows"]:
        speed = f"{r['step_speedup']:.2f}x" if r["step_speedup"] is not None else "-"
        lines.append(
            f"{r['devices']:>4} {r['path']:9} {r['prompts']:>7} {r['longest']:>7} {r['rollout_s']:9.2f} {r['train_s']:8.2f} "
            f"{r['step_s']:7.2f} {speed:>8} {r['completions_per_s']:8.1f} {r['throughput_vs_1']:6.2f}x"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.5B")
    p.add_argument("--quant", default="nvfp4")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=2048)
    p.add_argument("--median", type=float, default=300.0)
    p.add_argument("--cap-fraction", type=float, default=0.001, help="share of completions that run to --max-new")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--logprob-chunk", type=int, default=512)
    p.add_argument("--max-devices", type=int, default=8, help="data-parallel rows on up to this many devices; "
                   "0: none, only the tp row (needs --model-shards > 1), its ratios against itself (1.0)")  # fmt: skip
    p.add_argument("--skip-one-call", action="store_true", help="leave out the one-call baseline rows")
    p.add_argument("--model-shards", type=int, default=1, help="M > 1: a tensor-parallel row on a (1, M) mesh")
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.max_devices < 0 or args.model_shards < 1:
        p.error("--max-devices must be >= 0 and --model-shards >= 1")
    if args.max_devices == 0 and args.model_shards < 2:
        p.error("--max-devices 0 runs only the tensor-parallel row: it needs --model-shards M > 1")
    if args.max_devices == 0 and args.model_shards > len(jax.devices()):
        p.error(f"--max-devices 0 --model-shards {args.model_shards}: only {len(jax.devices())} devices are visible")
    # Each device compiles the shard's programs; the persistent cache serves the later ones.
    compile_cache.enable_compilation_cache(compile_cache.cache_dir(""))
    if args.tiny:
        args.prompts, args.group, args.prompt_len, args.max_new, args.median = 2, 4, 16, 16, 6.0
        args.micro_batch_size, args.logprob_chunk = 2, 8
    report = run(args)
    print("\n" + table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
