"""The step users run with DAPO's dynamic sampling: refill rounds vs one rollout call.

    python -m benchmarks.grpo_step --workload dapo --out $OUT/dapo.json          # GPU, 7B
    python -m benchmarks.grpo_step --workload dapo --tiny --out /tmp/dapo.json   # CPU smoke test

The gsm8k workload's long-tailed completions (benchmarks/rollout.py `gsm8k_inputs`: each
sequence stops at its drawn length) over 1 + `--refill-rounds` loader batches of prompts, a
share `--keep-rate` of whose groups get varied rewards (`dapo_reward`, scored by the reward pool's
workers through math-verify). Per base, two ways to fill a step of `prompts` groups:

- rounds: one `generate` call per batch, scored after it, the groups with varied rewards kept,
  until enough are (the loop before one-call dynamic sampling);
- one call: every batch in one `generate` call with the training loop's monitor
  (`rl.dynamic_sampling.GroupTracker`), sequences scored as they stop, unneeded ones dropped.

Both sample every sequence on the same PRNG stream, so they keep the same groups (up to the float
error of other row buckets, `kept_same`). Each is warmed up once (its programs compiled), then
timed once; the packed train step on the kept groups is timed once and added to both.
"""

from __future__ import annotations

import time
import zlib


def dapo_reward(completion: str, answer: str) -> float:
    """math-verify's check of the completion against the answer's number (a random model's is
    wrong), plus, for groups drawn to vary ("vary:" answers), the parity of a hash of the text."""
    from qerl_jax.rewards import accuracy_reward  # noqa: PLC0415 (imported in the reward workers)

    kind, number = answer.split(":", 1)
    return accuracy_reward(completion, number) + (zlib.crc32(completion.encode()) % 2 if kind == "vary" else 0.0)


REWARD = f"{__name__}:dapo_reward"


def _inputs(args, run, vocab: int):
    """(prompt ids [B * R, P], lengths [B * R * G], answers [B * R]) of R = 1 + refill rounds batches."""
    import numpy as np  # noqa: PLC0415

    from benchmarks.rollout import completion_lengths  # noqa: PLC0415

    batches, p, g = 1 + args.refill_rounds, run["prompts"], run["group"]
    ids = np.random.default_rng(1).integers(1, vocab, (batches * p, run["prompt_len"]), dtype=np.int32)
    lengths = completion_lengths(
        batches * p * g, median=run["median"], max_new=run["max_new"], cap_fraction=run["cap_fraction"]
    )
    varies = np.random.default_rng(2).random(batches * p) < args.keep_rate
    return ids, lengths, [f"{'vary' if v else 'same'}:7" for v in varies]


def _texts(tokens, lengths) -> list[str]:
    return [" ".join(map(str, t[:n].tolist())) for t, n in zip(tokens, lengths)]


def _rounds(sample, pool, ids, lengths, answers, p: int, g: int) -> dict:
    """Refill rounds: (kept groups, rollout s, reward s, rounds)."""
    import numpy as np  # noqa: PLC0415

    from qerl_jax.rl import dynamic_sampling  # noqa: PLC0415

    kept, t_roll, t_reward = [], 0.0, 0.0
    for b in range(len(answers) // p):
        prompts = np.arange(b * p, (b + 1) * p)
        rows = (prompts[:, None] * g + np.arange(g)).reshape(-1)
        t0 = time.perf_counter()
        batch = sample(ids[prompts], lengths[rows], rows, None)
        t_roll += time.perf_counter() - t0
        t0 = time.perf_counter()
        scores = pool.score(_texts(np.asarray(batch.tokens), np.asarray(batch.lengths)), [answers[r // g] for r in rows], REWARD)
        t_reward += time.perf_counter() - t0
        kept += (b * p + dynamic_sampling.kept_groups(scores, g, p - len(kept))).tolist()
        if len(kept) >= p:
            break
    return {"kept": kept, "rollout_s": t_roll, "reward_s": t_reward, "rounds": b + 1}


def _one_call(sample, pool, ids, lengths, answers, p: int, g: int, keep_rate: float) -> dict:
    """Every batch in one call with the loop's monitor: (kept groups, rollout s, reward wait s, batch)."""
    import concurrent.futures  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from qerl_jax.experience import map_future  # noqa: PLC0415
    from qerl_jax.rl import dynamic_sampling  # noqa: PLC0415

    def submit(seqs, tokens, lens) -> concurrent.futures.Future:
        each = pool.submit_each(_texts(tokens, lens), [answers[s // g] for s in seqs], [REWARD])
        return map_future(each, lambda each_RxK: (each_RxK[0], each_RxK))

    tracker = dynamic_sampling.GroupTracker(len(answers), g, p, submit, keep_rate=keep_rate)
    t0 = time.perf_counter()
    batch = sample(ids, lengths, np.arange(len(lengths)), tracker)
    t_roll = time.perf_counter() - t0
    t0 = time.perf_counter()
    shaped, _ = tracker.results()
    t_reward = time.perf_counter() - t0
    kept = dynamic_sampling.kept_groups(shaped[: tracker.end * g], g, p).tolist()
    return {"kept": kept, "rollout_s": t_roll, "reward_s": t_reward, "groups_needed": tracker.end, "batch": batch}


def run_dapo_case(args, fmt: str) -> dict:
    """The dapo workload (module doc) for one base."""
    import jax
    import numpy as np

    from benchmarks import common
    from benchmarks import rollout as rollout_bench
    from qerl_jax import lora, optim, reward_pool
    from qerl_jax.models.qwen2 import ModelConfig
    from qerl_jax.rl import dynamic_sampling
    from qerl_jax.rl.step import init_train_state
    from qerl_jax.rollout.sampler import RolloutOptions, RolloutPart, generate
    from qerl_jax.rollout.sampling import SamplingConfig

    run, _, _ = rollout_bench.gsm8k_inputs(args)
    config = ModelConfig(**(rollout_bench.TINY if args.tiny else rollout_bench.QWEN25_7B))
    backend = common.backend_for(fmt)
    frozen = common.random_params(config, quant=fmt, seed=0)
    lcfg = lora.LoraConfig(rank=run["lora_rank"], alpha=2.0 * run["lora_rank"])
    optimizer = optim.make_optimizer(1e-5, warmup_steps=0, total_steps=100)
    state = init_train_state(lora.init_lora(jax.random.key(1), config, lcfg), optimizer)
    policy = {**frozen, "lora": state.lora}
    p, g = run["prompts"], run["group"]
    ids, lengths, answers = _inputs(args, run, config.vocab_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=run["max_new"], ignore_eos=True)
    options = RolloutOptions(backend=backend, min_prompt_len=run["prompt_len"])

    planned = dynamic_sampling.groups_to_plan(p, args.keep_rate) * g  # the loop's rows for this keep rate

    def sample(prompt_ids, limits, streams, monitor):
        batch = generate(
            config, policy, prompt_ids, np.ones_like(prompt_ids), jax.random.key(3), sampling, group_size=g,
            lora_scale=lora.lora_scale(lcfg), max_new_tokens_per_seq=limits,
            part=RolloutPart(streams=streams, monitor=monitor, expected_seqs=planned if monitor is not None else None),
            options=options,
        )  # fmt: skip
        jax.block_until_ready(batch.tokens)
        return batch

    row = {"format": fmt, "backend": backend, "model": "tiny" if args.tiny else "7B", "prompts": p, "group": g,
           "batches": len(answers) // p, "keep_rate_drawn": float(np.mean([a.startswith("vary") for a in answers])),
           "max_new_tokens": run["max_new"]}  # fmt: skip
    with reward_pool.RewardPool() as pool:
        pool.score(["1"], ["vary:7"], REWARD)  # workers up, the reward imported
        short = np.ones_like(lengths)  # warm-up: the programs compiled, every row stopped at once
        _rounds(sample, pool, ids, short, answers, p, g)
        _one_call(sample, pool, ids, short, answers, p, g, args.keep_rate)
        rounds = _rounds(sample, pool, ids, lengths, answers, p, g)
        one = _one_call(sample, pool, ids, lengths, answers, p, g, args.keep_rate)
    kept = np.asarray(one["kept"])
    rows = (kept[:, None] * g + np.arange(g)).reshape(-1)
    train_s = common.time_packed_train(args, config, frozen, state, optimizer, one.pop("batch"), rows, lcfg, backend)
    row.update(train_s=train_s, kept_same=rounds["kept"] == one["kept"], groups_kept=len(kept))
    for name, r in (("rounds", rounds), ("one_call", one)):
        row[name] = {k: v for k, v in r.items() if k != "kept"}
        row[name]["step_s"] = r["rollout_s"] + r["reward_s"] + train_s
    row["one_call_over_rounds"] = row["one_call"]["step_s"] / row["rounds"]["step_s"]
    row["rollout_reward_ratio"] = (one["rollout_s"] + one["reward_s"]) / (rounds["rollout_s"] + rounds["reward_s"])
    return row


def report_dapo(rows: list[dict]) -> None:
    print("\nGRPO step with DAPO dynamic sampling (gsm8k lengths): refill rounds vs one call")
    print(f"{'base':6} {'mode':9} {'rounds':>6} {'rollout s':>10} {'reward s':>9} {'train s':>8} {'step s':>8} {'ratio':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['format']:6} error: {r['error'][:300]}")
            continue
        for mode in ("rounds", "one_call"):
            m = r[mode]
            ratio = r["one_call_over_rounds"] if mode == "one_call" else 1.0
            print(
                f"{r['format']:6} {mode:9} {m.get('rounds', 1):6d} {m['rollout_s']:10.2f} {m['reward_s']:9.2f} "
                f"{r['train_s']:8.2f} {m['step_s']:8.2f} {ratio:6.2f}"
            )
        print(f"{r['format']:6} kept groups {r['groups_kept']}, the same in both: {r['kept_same']}")
