"""Data-parallel scaling: rollout and GRPO train step on all local GPUs vs one, same batch.

    python -m benchmarks.data_parallel --out $OUT/dp.json        # e.g. 2 x H200, 7B
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python -m benchmarks.data_parallel --tiny --out /tmp/dp.json   # CPU smoke test

A Qwen2.5-shaped random NVFP4 policy (benchmarks/common.py) with LoRA is run twice on
the same inputs: on one device, and on a ("data", "model") = (n, 1) mesh of all n devices
(`qerl_jax.sharding`: params replicated, rollout rows and training sequences split over
"data" through `generate(options=RolloutOptions(batch_sharding=...))` and `shard_batch`; XLA all-reduces the LoRA
gradients). Rollout: prompts x group sequences, --decode-steps sampling steps with the cache
sized for --max-new-tokens (a step costs the same at every position), the second of two
identical calls timed. Train: one DAPO step on prompt + new-token sequences (micro-batches,
per-layer remat), the second of two steps timed. Reported: times, tokens/s, speed-up n-GPU
vs 1-GPU on the same batch (strong scaling) and its efficiency (speed-up / n), throughput
with n times the batch (weak scaling: the same rows per device), and whether the sampled
tokens are equal.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks import common
from qerl_jax import sharding  # noqa: E402
from qerl_jax.lora import LoraConfig, init_lora, lora_scale, with_lora  # noqa: E402
from qerl_jax.optim import make_optimizer  # noqa: E402
from qerl_jax.rl import packing  # noqa: E402
from qerl_jax.rl import step as rl_step  # noqa: E402
from qerl_jax.rl.losses import LossConfig  # noqa: E402
from qerl_jax.rollout import RolloutOptions, SamplingConfig, generate  # noqa: E402


def _timed(fn):
    """(result, seconds) of the second of two calls (the first compiles)."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def run(args) -> dict:
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        raise SystemExit(f"needs at least 2 devices, found {n} ({devices})")
    config = common.model_config("tiny" if args.tiny else args.model)
    params = common.random_params(config, quant=args.quant, seed=0)
    lcfg = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    lora = init_lora(jax.random.key(1), config, lcfg)
    # Non-zero B so the adapters take part in the forward like in training.
    lora = jax.tree.map(lambda x: x + 1e-3 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), lora)
    scale = lora_scale(lcfg)
    backend = "xla" if jax.default_backend() == "cpu" else "pallas"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(ids)
    rows = args.prompts * args.group
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.decode_steps, ignore_eos=True)
    optimizer = make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    t_total = args.prompt_len + args.max_new_tokens
    # The training loop's layout (`rl.packing`), one sequence per row: every row is full length.
    batch = packing.pack_batch(
        common.random_rl_batch(config, batch=rows, seq_len=t_total, prompt_len=args.prompt_len),
        t_total,
        rows_multiple=args.micro_batch_size,
        rows=[[i] for i in range(rows)],
    )
    mesh = sharding.make_mesh(n, 1)
    report = {
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "model": "tiny" if args.tiny else args.model,
        "quant": args.quant,
        "backend": backend,
        "rows": rows,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "max_new_tokens": args.max_new_tokens,
        "train_seq_len": t_total,
        "micro_batch_size": args.micro_batch_size,
    }

    def one_mode(name: str, place, batch_sharding):
        policy = place(with_lora(params, lora))
        kw = dict(group_size=args.group, lora_scale=scale)
        kw["options"] = RolloutOptions(backend=backend, batch_sharding=batch_sharding)
        out, roll_s = _timed(lambda: generate(config, policy, ids, mask, jax.random.key(3), sampling, **kw))
        frozen = place({"base": params["base"], "norms": params["norms"]})
        step = rl_step.make_train_step(
            config,
            LossConfig(kind="dapo"),
            optimizer,
            lora_scale=scale,
            backend=backend,
            remat=True,
            micro_batch_size=args.micro_batch_size,
            logprob_chunk=args.logprob_chunk,
        )
        train_batch = sharding.shard_batch(batch, mesh) if batch_sharding is not None else jax.device_put(batch)

        def train_once():
            state = place(rl_step.init_train_state(lora, optimizer))
            return step(state, frozen, train_batch)

        (state, metrics), train_s = _timed(train_once)
        res = {}
        if batch_sharding is not None:  # weak scaling: n times the sequences, the same rows per device
            ids_n, mask_n = np.tile(ids, (n, 1)), np.tile(mask, (n, 1))
            _, weak_roll_s = _timed(lambda: generate(config, policy, ids_n, mask_n, jax.random.key(3), sampling, **kw))
            batch_n = sharding.shard_batch({k: np.concatenate([v] * n) for k, v in batch.items()}, mesh)
            _, weak_train_s = _timed(lambda: step(place(rl_step.init_train_state(lora, optimizer)), frozen, batch_n))
            res.update(
                weak_rollout_tokens_per_s=n * rows * args.decode_steps / weak_roll_s,
                weak_train_tokens_per_s=n * rows * t_total / weak_train_s,
                weak_rollout_s=weak_roll_s,
                weak_train_s=weak_train_s,
            )
        res |= {
            "rollout_s": roll_s,
            "rollout_tokens_per_s": rows * args.decode_steps / roll_s,
            "train_s": train_s,
            "train_tokens_per_s": rows * t_total / train_s,
            "loss": float(metrics["loss"]),
        }
        print(name, json.dumps(res), flush=True)
        return res, np.asarray(out.tokens), state

    single, tokens_1, state_1 = one_mode("1-device", lambda t: jax.device_put(t, devices[0]), None)
    replicated = sharding.replicated(mesh)
    dp, tokens_n, state_n = one_mode(
        f"{n}-device", lambda t: jax.device_put(t, replicated), sharding.data_sharding(mesh)
    )
    report["one_device"], report["data_parallel"] = single, dp
    # Bit-equal on CPU (tests/test_sharding.py); on GPUs the per-device batch changes the matmul
    # tiling, so logits differ in the last bits and temperature-1 samples drift apart.
    report["tokens_equal"] = bool(np.array_equal(tokens_1, tokens_n))
    report["token_agreement"] = float((tokens_1 == tokens_n).mean())
    report["first_token_agreement"] = float((tokens_1[:, 0] == tokens_n[:, 0]).mean())
    report["lora_max_abs_diff_after_step"] = float(
        max(
            np.abs(np.asarray(a) - np.asarray(b)).max()
            for a, b in zip(jax.tree.leaves(state_1.lora), jax.tree.leaves(state_n.lora))
        )
    )
    for phase in ("rollout", "train"):
        speedup = single[f"{phase}_s"] / dp[f"{phase}_s"]
        report[f"{phase}_speedup"] = speedup
        report[f"{phase}_efficiency"] = speedup / n
        weak = dp[f"weak_{phase}_tokens_per_s"] / single[f"{phase}_tokens_per_s"]
        report[f"{phase}_weak_speedup"] = weak
    step_1 = single["rollout_s"] * args.max_new_tokens / args.decode_steps + single["train_s"]
    step_n = dp["rollout_s"] * args.max_new_tokens / args.decode_steps + dp["train_s"]
    report["grpo_step_speedup"] = step_1 / step_n  # rollout extrapolated to max_new_tokens
    weak_n = dp["weak_rollout_s"] * args.max_new_tokens / args.decode_steps + dp["weak_train_s"]
    report["grpo_step_weak_throughput_speedup"] = n * step_1 / weak_n
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7B")
    p.add_argument("--quant", default="nvfp4")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--logprob-chunk", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.group, args.prompt_len, args.max_new_tokens, args.decode_steps = 2, 4, 16, 16, 8
        args.micro_batch_size, args.logprob_chunk = 2, 8
    report = run(args)
    print(
        f"\n{report['model']} {report['quant']} on {len(report['devices'])} x {report['device_kind']}: "
        f"{report['rows']} sequences\n"
        f"{'phase':8} {'1 device s':>11} {'n devices s':>12} {'speed-up':>9} {'efficiency':>10} "
        f"{'n x batch: throughput':>22}"
    )
    for phase in ("rollout", "train"):
        print(
            f"{phase:8} {report['one_device'][phase + '_s']:11.2f} {report['data_parallel'][phase + '_s']:12.2f} "
            f"{report[phase + '_speedup']:8.2f}x {report[phase + '_efficiency']:10.0%} "
            f"{report[phase + '_weak_speedup']:21.2f}x"
        )
    print(
        f"GRPO step (rollout extrapolated to {report['max_new_tokens']} tokens): same batch {report['grpo_step_speedup']:.2f}x, "
        f"n x batch throughput {report['grpo_step_weak_throughput_speedup']:.2f}x"
    )
    print(
        f"sampled tokens equal: {report['tokens_equal']}; LoRA after one step max |diff| {report['lora_max_abs_diff_after_step']:.2e}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
