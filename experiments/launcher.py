"""Many runs side by side on one GPU or several: the launcher behind experiments/fidelity,
experiments/qwen_gsm8k and experiments/aqn_dose.

An `Experiment` names a config module with `ARMS` and `get_config(arm)`; the launcher starts one
process per unfinished stage, all at once, sharing one GPU (or, with --gpus N, each process on the
least busy of N GPUs through CUDA_VISIBLE_DEVICES):
- "base": greedy pass@1 of the untrained model in bf16 and NVFP4 (the eval command's
  `qerl_jax.evaluation`) and claim (a): the same prompts sampled with the same keys from the
  bf16, NVFP4 and NVFP4 + AQN(sigma_start) policies, the per-token entropy of each (exact, from a
  forward over the samples, and the Monte Carlo -log p of the sampled tokens), paired per prompt.
  The config module must define the arms "bf16", "nvfp4" and "nvfp4_aqn".
- "train": one process per (arm, seed) of the real loop (`qerl_jax.train.train`) with the arm's
  config; only the model path, seed, workdir and --steps (the schedule's length) are set here.
  A run that finishes is then evaluated greedily on the experiment's final datasets.
Each process stops cleanly (checkpointed, scalars flushed) before --max-minutes; the launcher
kills what is still running 20 s before it. The same command again resumes: finished stages are
skipped, runs continue from their checkpoints. `<out>/calls.jsonl` records each call's wall time
and the hash of the source tree it ran (`code_sha256`); an experiment with `same_code` refuses a
call from another tree than the one its `experiment.json` recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_MODELS = ("bf16", "nvfp4", "nvfp4_aqn")  # nvfp4_aqn reuses the NVFP4 policy with noisy norms
KILL_MARGIN_S = 20.0
# The longest a run waits for the first run of its base format to compile (`staggered`).
STAGGER_MAX_MINUTES = 8.0
# A process waiting for a slot does not start with less than this left (compiling, one step, the checkpoint).
START_MIN_MINUTES = 3.0
LIGHT_SKIP = {"checkpoints", "adapter", "jax_cache", "tiny_model"}
# What a run computes with: the library, the kernels, the configs and this launcher (`code_sha256`).
CODE_DIRS = ("qerl_jax", "pallas_kernels", "configs")
CODE_FILES = (os.path.join("experiments", "launcher.py"),)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """What differs between experiments; the launcher does the rest.

    module: the experiment's entry module (workers are started as `python -m <module> --worker ...`).
    config_module: importable module with ARMS and get_config(arm).
    final_eval_datasets: datasets of the greedy evaluation after the last step; () = the config's
      eval.datasets.
    train_reserve_minutes: minutes a train process keeps free at the end of its budget (the
      checkpoint, and whatever train.train does after the last step: its own eval, the adapter export).
    eval_minutes: minutes a finished run's final evaluation needs; with less left it waits for the
      next call (where it runs first).
    default_gguf: returns the model file when --gguf is not given (None: --gguf is required).
    summarize: (out, results) -> summary dict.
    stages: the stages it has ("base" needs the arms bf16, nvfp4 and nvfp4_aqn).
    same_code: every call of one --out must run the source tree its first call ran.
    """

    name: str
    module: str
    config_module: str
    default_steps: int
    default_results: str
    summarize: Callable[[str, str], dict]
    final_eval_datasets: tuple[str, ...] = ()
    train_reserve_minutes: float = 1.5
    eval_minutes: float = 1.0
    max_mem_fraction: float = 0.3
    default_gguf: Callable[[], str] | None = None
    stages: tuple[str, ...] = ("base", "train")
    same_code: bool = False

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(importlib.import_module(self.config_module).ARMS)


# ----------------------------------------------------------------------------- configs


def run_config(exp: Experiment, args, arm: str, seed: int):
    """The arm's config with this experiment's model path, steps, seed and workdir (+ the --tiny shrink)."""
    cfg = importlib.import_module(exp.config_module).get_config(arm)
    cfg.model.path = args.gguf
    cfg.seed = seed
    cfg.workdir = os.path.join(args.out, "runs", arm, f"seed{seed}")
    cfg.resume = os.path.isdir(os.path.join(cfg.workdir, "checkpoints"))  # continue a run that has begun
    cfg.train.total_steps = args.steps
    cfg.compile_cache_dir = os.path.join(args.out, "jax_cache")  # shared by the experiment's processes
    if args.tiny:
        cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 4, 16
        cfg.rl.micro_batch_size, cfg.rl.reward_workers = 8, 1
        cfg.eval.num_examples, cfg.eval.batch_size, cfg.eval.max_new_tokens = 4, 4, 16
        cfg.train.sample_every, cfg.train.checkpoint_every = 1, 2
    cfg.aqn.num_stages = min(cfg.aqn.num_stages, args.steps)  # every noise stage needs a step
    return cfg


def final_eval_config(exp: Experiment, args, arm: str, seed: int):
    """The config of the greedy evaluation of a finished run: its LoRA, the final datasets."""
    cfg = run_config(exp, args, arm, seed)
    cfg.eval.checkpoint = cfg.workdir
    cfg.eval.output_dir = os.path.join(cfg.workdir, "eval", f"step_{args.steps}")
    cfg.eval.num_samples = 0
    if exp.final_eval_datasets:
        cfg.eval.datasets = tuple(exp.final_eval_datasets)
    return cfg


# ----------------------------------------------------------------------------- workers


def _deadline_minutes(deadline: float, reserve: float) -> float:
    return max((deadline - time.time()) / 60 - reserve, 1e-6)


def worker_train(exp: Experiment, args) -> None:
    """Trains (resuming) until the run's last step or the deadline; evaluates a finished run."""
    from qerl_jax import evaluation, train  # noqa: PLC0415

    if exp.same_code:  # a worker started later in a call imports the tree as it is then
        path = os.path.join(args.out, "experiment.json")
        check_same_code(exp, json.load(open(path)), code_sha256(), path)
    cfg = run_config(exp, args, args.arm, args.seed)
    reserve = 0.0 if args.tiny else exp.train_reserve_minutes
    cfg.train.stop_after_minutes = _deadline_minutes(args.deadline, reserve)
    train.train(cfg)
    finished = os.path.isdir(os.path.join(cfg.workdir, "adapter"))  # exported after the last step only
    if finished and not _run_done(args, args.arm, args.seed):
        if not args.tiny and _deadline_minutes(args.deadline, 0.0) < args.eval_minutes:
            print(f"finished; less than --eval-minutes={args.eval_minutes} left: the next call evaluates it")
            return
        evaluation.evaluate(final_eval_config(exp, args, args.arm, args.seed))


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


def worker_base(exp: Experiment, args) -> None:
    """Greedy accuracy of the untrained model (bf16, NVFP4) and claim (a)'s entropies."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from qerl_jax import aqn, evaluation  # noqa: PLC0415
    from qerl_jax import run_config as typed  # noqa: PLC0415
    from qerl_jax.data import load_math_dataset, tokenize_prompts  # noqa: PLC0415
    from qerl_jax.policy import load_policy  # noqa: PLC0415
    from qerl_jax.rollout.sampler import RolloutOptions, generate  # noqa: PLC0415

    out_dir = os.path.join(args.out, "base")
    os.makedirs(out_dir, exist_ok=True)
    group = 2 if args.tiny else args.entropy_group
    num_prompts = 4 if args.tiny else args.entropy_prompts
    result: dict = {"num_prompts": num_prompts, "group_size": group, "models": {}}
    samples = {}
    key = jax.random.key(1234)
    for name in BASE_MODELS:
        run_cfg = run_config(exp, args, name, 0)
        if exp.final_eval_datasets:  # the base models are scored on what the trained runs are (MATH500 too)
            run_cfg.eval.datasets = tuple(exp.final_eval_datasets)
        cfg = typed.from_config_dict(run_cfg)
        if name != "nvfp4_aqn":
            policy = load_policy(cfg)
            summary_file = os.path.join(out_dir, name, "summary.json")
            if not os.path.isfile(summary_file):
                evaluation.evaluate_params(
                    cfg,
                    policy,
                    dict(policy.frozen),
                    lora_scale=1.0,
                    output_dir=os.path.join(out_dir, name),
                    max_batch=cfg.rollout.max_batch or None,
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
            acfg = cfg.aqn
            stage1_step = -(-acfg.total_steps // acfg.num_stages)
            params = {
                **policy.frozen,
                "norms": aqn.apply_aqn(acfg, policy.frozen["norms"], jax.random.key(7), stage1_step),
            }
            result["aqn_sigma"] = float(aqn.aqn_sigma(acfg, stage1_step))
        sampling = typed.sampling_config(cfg, policy)
        batch = generate(
            policy.config,
            params,
            tok.input_ids,
            tok.attention_mask,
            key,
            sampling,
            group_size=group,
            max_batch=cfg.rollout.max_batch or None,  # 0 = one batch
            options=RolloutOptions(backend=policy.backend),
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


def _base_done(out: str) -> bool:
    return os.path.isfile(os.path.join(out, "base", "entropy.json"))


def _progress(args, arm: str, seed: int) -> int:
    """Steps logged so far by a run (its scalars.jsonl)."""
    path = os.path.join(args.out, "runs", arm, f"seed{seed}", "tensorboard", "scalars.jsonl")
    if not os.path.isfile(path):
        return 0
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r["step"] for r in rows if "aqn/sigma" in r]  # train steps (evaluations log eval/* only)
    return max(steps) + 1 if steps else 0


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def code_sha256(repo: str = REPO) -> str:
    """sha256 over the paths and contents of the source a run computes with (CODE_DIRS' .py files, CODE_FILES)."""
    rel = list(CODE_FILES) + [
        os.path.relpath(os.path.join(d, name), repo)
        for top in CODE_DIRS
        for d, _, names in os.walk(os.path.join(repo, top))
        for name in names
        if name.endswith(".py")
    ]
    h = hashlib.sha256()
    for path in sorted(rel):
        h.update(path.encode() + b"\0")
        with open(os.path.join(repo, path), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def check_same_code(exp: Experiment, recorded: dict, code: str, path: str) -> None:
    """With `exp.same_code`, one line and exit 2 when the tree differs from the one `recorded` (experiment.json)."""
    if exp.same_code and recorded.get("code", code) != code:
        _fail(
            f"{path} records the source tree {recorded['code'][:12]}, this tree is {code[:12]}: every run of "
            f"{exp.name} comes from one tree (check out that tree, or use another --out)"
        )


def _check_experiment_file(exp: Experiment, args) -> str:
    """Same --steps / --tiny / model on every call of one --out (the schedules depend on them), and
    with `exp.same_code` the same source tree; returns this tree's `code_sha256`."""
    path = os.path.join(args.out, "experiment.json")
    here = {"steps": args.steps, "tiny": args.tiny, "gguf": os.path.basename(args.gguf)}
    sha, code = file_sha256(args.gguf), code_sha256()
    if os.path.isfile(path):
        before = json.load(open(path))
        if {k: before.get(k) for k in here} != here or before.get("sha256", sha) != sha:
            sys.exit(f"{path} records {before}; this call has {here} (sha256 {sha}): use another --out")
        check_same_code(exp, before, code, path)
    else:
        os.makedirs(args.out, exist_ok=True)
        json.dump({**here, "sha256": sha, "code": code}, open(path, "w"))
    return code


def _take_base_from(args) -> None:
    """Copies a finished base stage of an earlier --out (same model and steps) into this one."""
    src = os.path.abspath(args.base_from)
    if _base_done(args.out):
        return
    theirs = json.load(open(os.path.join(src, "experiment.json")))
    ours = json.load(open(os.path.join(args.out, "experiment.json")))
    if theirs.get("sha256") != ours["sha256"]:
        sys.exit(f"--base-from {src}: its experiment.json records another model ({theirs.get('sha256')})")
    shutil.copytree(os.path.join(src, "base"), os.path.join(args.out, "base"), dirs_exist_ok=True)
    minutes = sum(c["minutes"] for c in _calls(src))
    _record_call(args.out, {"base_from": src, "minutes": minutes})
    print(f"base stage taken from {src}")


def _calls(out: str) -> list[dict]:
    path = os.path.join(out, "calls.jsonl")
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.isfile(path) else []


def _record_call(out: str, row: dict) -> None:
    with open(os.path.join(out, "calls.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def _check_args(exp: Experiment, args) -> None:
    """One clear line and exit status 2 for bad input, before anything is written."""
    if not os.path.isfile(args.gguf):
        _fail(f"--gguf {args.gguf}: no such file")
    if args.steps < 1 or args.max_minutes <= 0:
        _fail(f"--steps must be >= 1 and --max-minutes > 0 (got {args.steps}, {args.max_minutes})")
    if args.parallel < 0:
        _fail(f"--parallel {args.parallel}: expected 0 (all at once) or a positive number of processes")
    if args.gpus < 1:
        _fail(f"--gpus {args.gpus}: expected the number of GPUs to spread the processes over (>= 1)")
    train_runs(exp, args)
    if args.base_from:
        for name in ("experiment.json", os.path.join("base", "entropy.json")):
            if not os.path.isfile(os.path.join(args.base_from, name)):
                _fail(f"--base-from {args.base_from}: no {name} there (expected a finished base stage)")
    for path in exp.final_eval_datasets:
        if not os.path.isfile(path):
            _fail(f"final evaluation dataset {path}: no such file")


def train_runs(exp: Experiment, args) -> list[tuple[str, int]]:
    """The (arm, seed) runs of this call: --runs ARM:SEED if given, else every --arms x --seeds."""
    if not args.runs:
        return [(arm, seed) for arm in args.arms for seed in args.seeds]
    runs = []
    for item in args.runs:
        arm, _, seed = item.rpartition(":")
        if arm not in exp.arms or not seed.isdigit():
            _fail(f"--runs {item}: expected ARM:SEED with ARM one of {', '.join(exp.arms)} and SEED >= 0")
        runs.append((arm, int(seed)))
    return list(dict.fromkeys(runs))


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def launch(exp: Experiment, args) -> int:
    start = time.time()
    deadline = start + 60 * args.max_minutes - KILL_MARGIN_S
    _check_args(exp, args)
    code = _check_experiment_file(exp, args)
    with open(os.path.join(args.out, "commands.txt"), "a") as f:
        f.write(" ".join(["python", "-m", exp.module, *sys.argv[1:]]) + "\n")
    if args.base_from:
        _take_base_from(args)
    jobs = []
    if "base" in args.stages and not _base_done(args.out):
        jobs.append(("base", None, None))
    if "train" in args.stages:
        jobs += [("train", arm, seed) for arm, seed in train_runs(exp, args) if not _run_done(args, arm, seed)]
    if not jobs:
        print("nothing to do: every stage is done; run --summarize")
        return 0
    progress = {job: _progress(args, job[1], job[2]) for job in jobs if job[0] == "train"}
    jobs = queue_order(jobs, progress)
    slots = min(args.parallel or len(jobs), len(jobs))
    fraction = args.mem_fraction or mem_fraction(slots, args.gpus, exp.max_mem_fraction)
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.4f}",
        "PYTHONUNBUFFERED": "1",
    }
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)

    def launch(job):
        stage, arm, seed = job
        name = "base" if stage == "base" else f"{arm}_seed{seed}"
        cmd = [sys.executable, "-m", exp.module, "--worker", stage, "--gguf", args.gguf, "--out", args.out]
        cmd += ["--steps", str(args.steps), "--deadline", str(deadline), "--eval-minutes", str(args.eval_minutes)]
        cmd += ["--entropy-prompts", str(args.entropy_prompts), "--entropy-group", str(args.entropy_group)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--arm", arm, "--seed", str(seed)] if stage == "train" else []
        job_env = env
        if args.gpus > 1:
            busy = [gpu_of[j] for j, (_, p, _) in started.items() if p.poll() is None]
            gpu_of[job] = least_busy_gpu(busy, args.gpus)
            job_env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu_of[job])}
            name = f"{name} (GPU {gpu_of[job]})"
        log = open(os.path.join(log_dir, f"{name.split(' ')[0]}.log"), "a")
        started[job] = (name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env, cwd=REPO), log)

    started: dict = {}
    gpu_of: dict = {}
    waits_for = waits_for_compile(exp, jobs, progress, args.steps)
    stagger_until = time.time() + 60 * STAGGER_MAX_MINUTES

    def compiled(job) -> bool:
        """Whether `job`'s followers may start: it has logged a step in this call, or ended."""
        return job in started and (
            _progress(args, job[1], job[2]) > progress.get(job, 0)
            or started[job][1].poll() is not None
            or time.time() > stagger_until
        )

    pending = list(jobs)
    while time.time() < deadline + KILL_MARGIN_S / 2:
        running = sum(p.poll() is None for _, p, _ in started.values())
        late = time.time() > deadline - 60 * START_MIN_MINUTES  # no time to compile, step and save: the next call
        for job in [] if late else to_launch(pending, waits_for, running, slots, compiled):
            launch(job)
            pending.remove(job)
            print(f"started {started[job][0]} ({len(started)} of {len(jobs)})", flush=True)
        if (late or not pending) and all(p.poll() is not None for _, p, _ in started.values()):
            break
        time.sleep(5)
    print(
        f"{len(started)} of {len(jobs)} processes ran (at most {slots} at once, XLA_PYTHON_CLIENT_MEM_FRACTION="
        f"{fraction:.3f}); logs in {log_dir}" + (f"; {len(pending)} did not start: the next call" if pending else "")
    )
    procs = [started[job] for job in jobs if job in started]
    jobs = [job for job in jobs if job in started]
    for name, p, log in procs:
        if p.poll() is None:
            print(f"{name}: still running at the deadline; terminated (its scalars are flushed every step)")
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
    minutes = (time.time() - start) / 60
    stepped = sum(_progress(args, arm, seed) - progress[(stage, arm, seed)] for stage, arm, seed in jobs if stage == "train")
    row = {"start": start, "minutes": minutes, "jobs": [n for n, _, _ in procs], "steps": stepped, "gpus": args.gpus}
    _record_call(args.out, {**row, "code": code})
    print(f"\n{stepped} train steps in all in {minutes:.1f} min ({stepped / minutes:.1f} a minute, every run together)")
    print(f"\n{'run':<28}{'exit':>6}{'steps':>8}  finished   ({minutes:.1f} min)")
    failed = 0
    for (stage, arm, seed), (name, p, _) in zip(jobs, procs):
        steps = "" if stage == "base" else f"{_progress(args, arm, seed)}/{args.steps}"
        done = _base_done(args.out) if stage == "base" else _run_done(args, arm, seed)
        failed += p.returncode not in (0, -signal.SIGTERM) and not done
        print(f"{name:<28}{p.returncode:>6}{steps:>8}  {'yes' if done else 'no'}")
    if args.copy_to:
        copy_light_outputs(args.out, args.copy_to)
    return 1 if failed else 0


def least_busy_gpu(busy: list[int], gpus: int) -> int:
    """The GPU (0..gpus-1) running the fewest of the `busy` processes' GPUs; ties: the lowest index."""
    return min(range(gpus), key=lambda g: (busy.count(g), g))


def mem_fraction(slots: int, gpus: int, most: float) -> float:
    """XLA_PYTHON_CLIENT_MEM_FRACTION of each process: 0.8 of a GPU shared by the processes on it, at most `most`."""
    return min(most, 0.8 / math.ceil(slots / gpus))


def queue_order(jobs: list[tuple], progress: dict[tuple, int]) -> list[tuple]:
    """The order processes start in when not all run at once: the base stage, then the runs with
    the most steps done (a run near its end finishes and frees its slot), then lower seeds (every
    arm gets its first seeds before any arm gets more), then the arms' order."""
    return sorted(jobs, key=lambda job: (job[0] != "base", -progress.get(job, 0), job[2] or 0))


def to_launch(pending: list[tuple], waits_for: dict[tuple, tuple], running: int, slots: int, compiled) -> list[tuple]:
    """The pending jobs to start now, in queue order: as many as free slots, skipping a job whose
    format's first run (`waits_for`) has not `compiled` yet."""
    free = slots - running
    chosen = []
    for job in pending:
        if len(chosen) >= free:
            break
        leader = waits_for.get(job)
        if leader is None or compiled(leader):
            chosen.append(job)
    return chosen


def waits_for_compile(exp: Experiment, jobs: list[tuple], progress: dict[tuple, int], steps: int) -> dict[tuple, tuple]:
    """{job: the job it waits for} (`staggered`) among the jobs that still train: a run at its last
    step only evaluates, so it neither waits for a run that trains nor holds one back."""
    _, waits_for = staggered(exp, [job for job in jobs if progress.get(job, 0) < steps])
    return waits_for


def staggered(exp: Experiment, jobs: list[tuple]) -> tuple[list[tuple], dict[tuple, tuple]]:
    """(jobs to start now, {job: the job it waits for}): the first train job of each base format
    starts at once with the base stage; the others of its format wait until it has logged a step
    in this call (or ended, or STAGGER_MAX_MINUTES passed). Runs of one format compile the same
    programs, so the later ones load them from the experiment's shared compilation cache instead of
    compiling them side by side with it."""
    config = importlib.import_module(exp.config_module)
    leaders, followers, first = [], {}, {}
    for job in jobs:
        stage, arm, _ = job
        if stage != "train":
            leaders.append(job)
            continue
        quant = config.get_config(arm).model.quant
        if quant in first:
            followers[job] = first[quant]
        else:
            first[quant] = job
            leaders.append(job)
    return leaders, followers


def copy_light_outputs(out: str, dest: str) -> None:
    """Everything under `out` but the checkpoints, adapters and compilation cache (for $OUT)."""
    for root, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if d not in LIGHT_SKIP]
        for name in files:
            src = os.path.join(root, name)
            dst = os.path.join(dest, os.path.relpath(src, out))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
    print(f"copied the scalars, evaluations and logs to {dest}")


# ----------------------------------------------------------------------------- command line


def parser(exp: Experiment, description: str) -> argparse.ArgumentParser:
    arms = exp.arms
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gguf", help="the model's GGUF file" + (" (default: the experiment's)" if exp.default_gguf else ""))
    p.add_argument("--out", required=True, help="experiment directory (runs, logs, base results)")
    p.add_argument("--steps", type=int, default=exp.default_steps, help="train.total_steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
    p.add_argument(
        "--runs", nargs="+", default=[], metavar="ARM:SEED", help="exactly these runs (instead of every --arms x --seeds)"
    )
    p.add_argument("--stages", nargs="+", default=list(exp.stages), choices=list(exp.stages))
    p.add_argument("--base-from", default="", help="an earlier --out whose finished base stage this one reuses")
    p.add_argument("--max-minutes", type=float, default=9.0, help="wall-clock budget of this call")
    p.add_argument(
        "--parallel", type=int, default=0, help="processes at once (default all); the others start as slots free"
    )
    p.add_argument("--gpus", type=int, default=1, help="spread the processes over this many GPUs (CUDA_VISIBLE_DEVICES)")
    p.add_argument(
        "--mem-fraction", type=float, default=0.0, help="per process (default 0.8 / the processes sharing a GPU)"
    )
    p.add_argument(
        "--eval-minutes",
        type=float,
        default=exp.eval_minutes,
        help="a finished run's final evaluation starts only with this many minutes left (else the next call)",
    )
    p.add_argument("--entropy-prompts", type=int, default=256, help="claim (a): prompts sampled per model")
    p.add_argument("--entropy-group", type=int, default=4, help="claim (a): samples per prompt")
    p.add_argument("--copy-to", default="", help="copy scalars, evaluations and logs there at the end ($OUT)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: 3 steps of tiny rollouts")
    p.add_argument("--summarize", action="store_true", help="write the PNG, table and claims from --out")
    p.add_argument("--results", default=exp.default_results)
    p.add_argument("--worker", choices=["base", "train"], help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=arms, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return p


def main(exp: Experiment, description: str, argv=None) -> int:
    args = parser(exp, description).parse_args(argv)
    if args.tiny and args.steps == exp.default_steps:
        args.steps = 3
    if args.summarize:
        exp.summarize(args.out, args.results)
        return 0
    if not args.gguf:
        if exp.default_gguf is None:
            _fail("--gguf is required (the model's GGUF file)")
        args.gguf = exp.default_gguf()
    args.gguf = os.path.abspath(args.gguf)
    args.out = os.path.abspath(args.out)
    if args.worker == "train":
        worker_train(exp, args)
        return 0
    if args.worker == "base":
        worker_base(exp, args)
        return 0
    return launch(exp, args)
