"""The real run on 1 and N GPUs: `qerl_jax.main` itself, timed from its own per-step scalars.

    python -m benchmarks.real_run --model q15.gguf --gpus 4 --out $OUT/real_run.json      # GPU
    python -m benchmarks.real_run --tiny --gpus 2 --layouts 1 mesh --out /tmp/rr.json     # CPU smoke
    python -m benchmarks.real_run --compare REF_WORKDIR NEW_WORKDIR                       # finished runs
    python -m benchmarks.real_run --model q15.gguf --gpus 4 --set rollout.max_staleness=1 # partial rollouts

Runs the recipe (--config, default configs/gsm8k.py, its model at --model) for --steps steps in
each layout, one after another, each alone on the machine:

- `1`: one GPU, the baseline;
- `mesh`: one process over the N GPUs, mesh.data = N, the same prompts (strong scaling);
- `procs`: one process per GPU (jax.distributed on localhost), mesh.data = N, the same prompts;
- `weak`: one process, mesh.data = N, N times the prompts (weak scaling);
- `tp`: one process, mesh.model = N (tensor parallel), the same prompts.

Each process's output goes to <workdir>/<layout>.<i>.log; a row counts the gRPC error lines in them
(`grpc_error_lines`: 0 for a run that succeeds). Each run's `tensorboard/scalars.jsonl` gives its
per-step `time/rollout_s`, `time/train_s`, `time/step_s` and kept groups. Reported over steps 1..
(step 0, which compiles, apart): their mean and median, completions per second (kept groups x group
size x steps over the summed step time), with partial rollouts (`--set rollout.max_staleness=K`) the
trained tokens' off-policy share and the largest staleness, and the ratios to the baseline. This is what RESULTS.md's
real-run rows are; the random-weight benchmarks (`data_parallel`, `grpo_step`) are checked against it.
--tiny: configs/tiny.py on N forced CPU devices.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

LAYOUTS = ("1", "mesh", "procs", "weak", "tp")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _recipe(config_path: str):
    """The config the recipe file builds (its prompts per step and group size size the runs)."""
    spec = importlib.util.spec_from_file_location("recipe", os.path.join(REPO, config_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _devices_env(devices: list[int], tiny: bool) -> dict[str, str]:
    if tiny:
        return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": _cpu_xla_flags(len(devices))}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}


def _cpu_xla_flags(devices: int) -> str:
    """The environment's XLA_FLAGS with its forced CPU device count replaced by `devices` (none for one,
    the CPU's own count): the runs' compiled programs then share keys in the compilation cache with
    other commands of the same XLA flags (the tests' runs of the tiny config)."""
    force = "--xla_force_host_platform_device_count"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(force)]
    return " ".join(flags + ([f"{force}={devices}"] if devices > 1 else []))


def commands(layout: str, args, workdir: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment additions, argv) of each process of `layout`'s run."""
    n, prompts = args.gpus, _recipe(args.config).rollout.prompts_per_step
    main = [sys.executable, "-m", "qerl_jax.main", f"--config={args.config}", f"--config.workdir={workdir}",
            f"--config.train.total_steps={args.steps}", "--config.eval.num_examples=0",
            f"--config.train.checkpoint_every={args.steps + 1}", f"--config.seed={args.seed}"]  # fmt: skip
    if args.model:
        main.append(f"--config.model.path={args.model}")
    main += [f"--config.{o}" for o in getattr(args, "overrides", ())]  # e.g. rollout.max_staleness=1, every layout
    if layout == "1":
        return [(_devices_env([0], args.tiny), main)]
    if layout == "procs":
        port = _free_port()
        mp = {"QERL_NUM_PROCESSES": str(n), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
        return [
            ({**_devices_env([i], args.tiny), **mp, "QERL_PROCESS_ID": str(i)}, [*main, f"--config.mesh.data={n}"])
            for i in range(n)
        ]
    flags = {
        "mesh": [f"--config.mesh.data={n}"],
        "weak": [f"--config.mesh.data={n}", f"--config.rollout.prompts_per_step={prompts * n}"],
        "tp": [f"--config.mesh.model={n}"],
    }[layout]
    return [(_devices_env(list(range(n)), args.tiny), [*main, *flags])]


def launch(procs: list[tuple[dict[str, str], list[str]]], log_stem: str, timeout: float) -> list[int]:
    """Runs the processes side by side (logs at log_stem.<i>.log) within one deadline; their exit
    codes (124: stopped at the deadline, or because another process of the run failed). Each runs
    in a session of its own, so stopping it stops its reward workers too."""
    running = []
    for i, (extra, argv) in enumerate(procs):
        log = open(f"{log_stem}.{i}.log", "w")
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
        p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        running.append((p, log))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in running):
        failed = any(p.returncode not in (None, 0) for p, _ in running)
        if failed or time.monotonic() > deadline:
            for p, _ in running:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    p.returncode = 124
            break
        time.sleep(0.5)
    for _, log in running:
        log.close()
    return [p.returncode for p, _ in running]


# What jax's coordination service and gRPC print when a process polls a service that has gone
# ("WatchTasksAsync failed for task 1: UNAVAILABLE: ... Connection refused"), and absl's C++ error
# lines ("E1128 15:06:18..."): none is expected from a run that succeeds (`distributed.leave`).
GRPC_ERROR = re.compile(r"WatchTasks|UNAVAILABLE|failed to connect|Connection refused|Shutdown barrier|^E\d{4} ")


def grpc_error_lines(log_stem: str, processes: int) -> int:
    """Lines of the processes' logs (log_stem.<i>.log) that GRPC_ERROR matches."""
    count = 0
    for i in range(processes):
        path = f"{log_stem}.{i}.log"
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                count += sum(1 for line in f if GRPC_ERROR.search(line))
    return count


def summarize(workdir: str, group_size: int) -> dict:
    """Per-step times of a run from its scalars: step 0 apart, then means and medians over the rest."""
    rows: dict[int, dict] = {}
    path = os.path.join(workdir, "tensorboard", "scalars.jsonl")
    for line in open(path) if os.path.isfile(path) else ():
        row = json.loads(line) if line.strip() else {}
        if "time/step_s" in row:
            rows.setdefault(row["step"], {}).update(row)
    steps = [rows[s] for s in sorted(rows)]
    if len(steps) < 2:
        return {"steps": len(steps)}
    later = steps[1:]
    total = sum(r["time/step_s"] for r in later)
    out = {"steps": len(steps), "step0_s": steps[0]["time/step_s"]}
    for r in later:  # what the rollout and its rewards cost together (rewards scored after it add)
        r["time/rollout_reward_s"] = r.get("time/rollout_s", 0.0) + r.get("time/reward_s", 0.0)
    for key in ("rollout_s", "rollout_reward_s", "train_s", "step_s"):
        values = [r[f"time/{key}"] for r in later if f"time/{key}" in r]  # a step that kept no group trains not
        out[key] = statistics.mean(values) if values else 0.0
        out[key.replace("_s", "_median_s")] = statistics.median(values) if values else 0.0
    kept = sum(r.get("rollout/groups_kept", 0) for r in later)
    out["completions_per_s"] = kept * group_size / total
    out["longest_mean"] = statistics.mean(r.get("rollout/response_length_max", 0) for r in later)
    # Finished tokens a step: what the rollout's time buys, comparable across trees (older ones
    # log no `rollout/decoded_tokens`).
    out["finished_tokens"] = statistics.mean(
        r.get("time/rollout_s", 0.0) * r.get("rollout/tokens_per_s", 0.0) for r in later
    )
    # decode_steps: the decode loop's steps a step (on a mesh summed over its data shards), the tail's length;
    # offpolicy_tokens_frac (partial rollouts, rollout.max_staleness >= 1): the trained tokens' off-policy share.
    # time/rollout_loop_*: the decode loop's host work between its segments and the segments themselves;
    # time/rollout_s less both is the call's set-up and assembly.
    for tag in (
        "rollout/unused_tokens_frac", "rollout/decode_steps", "rollout/decode_segments",
        "rollout/rows_per_decode_step", "rollout/offpolicy_tokens_frac", "rollout/resumed_tokens",
        "time/rollout_loop_host_s", "time/rollout_loop_device_s",
    ):  # fmt: skip
        logged = [r[tag] for r in later if tag in r]  # older trees log fewer
        out[tag.split("/", 1)[1]] = statistics.mean(logged) if logged else float("nan")
    out["staleness_max"] = max((r["rollout/staleness_max"] for r in later if "rollout/staleness_max" in r), default=0.0)
    return out


def run(args) -> dict:
    group = _recipe(args.config).rollout.group_size
    os.makedirs(args.workdir, exist_ok=True)
    report = {"config": args.config, "model": args.model, "gpus": args.gpus, "steps": args.steps, "rows": []}
    for layout in args.layouts:
        workdir = os.path.join(args.workdir, layout)
        codes = launch(commands(layout, args, workdir), workdir, args.timeout)
        row = {"layout": layout, "exit_codes": codes, "grpc_error_lines": grpc_error_lines(workdir, len(codes))}
        row.update(summarize(workdir, group))
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in report["rows"] if r["layout"] == "1" and "step_s" in r), None)
    for r in report["rows"]:
        if base is not None and "step_s" in r:
            r["step_vs_1"] = r["step_s"] / base["step_s"]
            r["step_median_vs_1"] = r["step_median_s"] / base["step_median_s"]
            r["throughput_vs_1"] = r["completions_per_s"] / base["completions_per_s"]
    return report


def compare(workdirs: list[str], group_size: int) -> str:
    """Finished runs' summaries side by side, each as a ratio of the first's (e.g. one tree against a
    reference tree, same seed): rollout + reward and the step, mean and median; the finished tokens
    a step and the share decoded for groups past the last one needed (NaN where not logged)."""
    rows = [(w, summarize(w, group_size)) for w in workdirs]
    base = rows[0][1]
    lines = [
        f"{'run':40} {'steps':>5} {'rollout+reward s (mean/median)':>31} {'step s (mean/median)':>21} "
        f"{'tokens/step':>11} {'unused':>6} {'x first':>19}"
    ]
    for w, r in rows:
        if "step_s" not in r:
            lines.append(f"{w:40} no steps")
            continue
        vs = "-"
        if "step_s" in base:
            vs = (f"{r['rollout_reward_s'] / base['rollout_reward_s']:.2f}/{r['rollout_reward_median_s'] / base['rollout_reward_median_s']:.2f}"
                  f" {r['step_s'] / base['step_s']:.2f}/{r['step_median_s'] / base['step_median_s']:.2f}")  # fmt: skip
        lines.append(
            f"{w:40} {r['steps']:5} {r['rollout_reward_s']:15.2f}/{r['rollout_reward_median_s']:<15.2f} "
            f"{r['step_s']:10.2f}/{r['step_median_s']:<10.2f} {r['finished_tokens']:11.0f} "
            f"{r['unused_tokens_frac']:6.3f} {vs:>19}"
        )
    return "\n".join(lines)


def table(report: dict) -> str:
    lines = [
        f"{report['config']} ({report['model'] or 'its own model'}), {report['steps']} steps, N = {report['gpus']}",
        f"{'layout':7} {'step 0 s':>8} {'rollout s':>9} {'train s':>8} {'step s (mean/median)':>21} "
        f"{'longest':>7} {'compl/s':>8} {'step x 1':>13} {'compl/s x 1':>11} {'off-policy':>10} {'stale':>5}",
    ]
    for r in report["rows"]:
        if "step_s" not in r:
            lines.append(f"{r['layout']:7} no steps (exit codes {r['exit_codes']})")
            continue
        vs = f"{r['step_vs_1']:.2f}/{r['step_median_vs_1']:.2f}" if "step_vs_1" in r else "-"
        lines.append(
            f"{r['layout']:7} {r['step0_s']:8.1f} {r['rollout_s']:9.2f} {r['train_s']:8.2f} "
            f"{r['step_s']:10.2f}/{r['step_median_s']:<10.2f} {r['longest_mean']:7.0f} {r['completions_per_s']:8.1f} "
            f"{vs:>13} {r.get('throughput_vs_1', float('nan')):10.2f}x {r['offpolicy_tokens_frac']:10.3f} "
            f"{r['staleness_max']:5.0f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gsm8k.py")
    p.add_argument("--model", default="", help="the recipe's model (config.model.path); empty: the config's")
    p.add_argument("--gpus", type=int, default=2, help="N, the GPUs of the multi-GPU layouts")
    p.add_argument("--layouts", nargs="+", default=["1", "mesh", "procs", "weak"], choices=LAYOUTS)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set", dest="overrides", nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
        help="config fields for every layout's run, e.g. rollout.max_staleness=1 (as --config.FIELD=VALUE)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds each layout's run may take")
    p.add_argument("--workdir", default="/tmp/real_run", help="one workdir per layout under it")
    p.add_argument("--tiny", action="store_true", help="configs/tiny.py on forced CPU devices (smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--compare", nargs="+", metavar="WORKDIR", help="only summarize these finished runs, as ratios of the first"
    )
    args = p.parse_args(argv)
    if args.compare:
        missing = [w for w in args.compare if not os.path.isfile(os.path.join(w, "tensorboard", "scalars.jsonl"))]
        if missing:
            p.error(f"--compare {missing[0]}: no tensorboard/scalars.jsonl there (a run's workdir was expected)")
        print(compare(args.compare, _recipe(args.config).rollout.group_size))
        return 0
    args.workdir = os.path.abspath(args.workdir)  # the runs start in the repository, not here
    args.model = os.path.abspath(args.model) if args.model and os.path.exists(args.model) else args.model
    if args.tiny:
        args.config, args.model, args.steps = "configs/tiny.py", "", min(args.steps, 3)
    if args.gpus < 2 and set(args.layouts) - {"1"}:
        p.error(f"--gpus {args.gpus}: the multi-GPU layouts need N >= 2")
    taken = [d for d in (os.path.join(args.workdir, layout) for layout in args.layouts) if os.path.exists(d)]
    if taken:  # each layout's run starts fresh; an earlier one is the user's to keep or delete
        p.error(f"--workdir {args.workdir}: {taken[0]} exists; pass another --workdir or delete it")
    report = run(args)
    print("\n" + table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(r.get("steps", 0) >= 2 and not any(r["exit_codes"]) for r in report["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
