"""The benchmarks' CPU smoke modes (`--tiny`) run through and write their JSON: the library's
interfaces move under the benchmarks, which only run on a GPU otherwise (two of them had stopped
working after the train step began taking packed batches only). rollout's (~80 s) is left to the
benchmark's own runs to keep CI short."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import COMPILE_ONLY_XLA_FLAGS, FAST_COMPILE_XLA_FLAGS, REPO, two_device_env

CASES = {
    "grpo_step": [],
    "grpo_step:dapo": ["--workload", "dapo"],  # its cases must run without an error row
    "train_step": [],
    "scale": [],
    "real_run": ["--gpus", "2", "--layouts", "1", "mesh"],  # the main job itself, 1 and 2 CPU devices
    # its documented CPU smoke sizes, one batch, with LoRA
    "devtools.decode_profile": ["--prompt-len", "16", "--cache-new-tokens", "32", "--batches", "2x2", "--lora-rank", "2"],
    "devtools.train_profile": [],
}


def _error_rows(report) -> list:
    """The dicts anywhere in a benchmark's JSON report that carry an "error" (a case that failed)."""
    if isinstance(report, dict):
        own = [report] if "error" in report else []
        return own + [row for value in report.values() for row in _error_rows(value)]
    if isinstance(report, list):
        return [row for value in report for row in _error_rows(value)]
    return []


@pytest.mark.parametrize("module", sorted(CASES))
def test_tiny_mode_runs(module, tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    name = module.split(":")[0]
    # The smoke runs compile many programs and run each a few times: XLA's -O0 saves them more compile time
    # than it costs them (~45 of ~200 CPU-s). real_run's too: its mesh layout then loads the programs of the
    # suite's `two_device_tiny_run` (multi-device commands are at -O0, `forced_devices_xla_flags`).
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAST_COMPILE_XLA_FLAGS, COMPILE_ONLY_XLA_FLAGS)
    extra = ["--workdir", str(tmp_path / "runs")] if name == "real_run" else []
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--tiny", "--out", str(out), *CASES[module], *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report and not _error_rows(report), _error_rows(report)  # every case ran (no child's error row)
    if module == "real_run":  # both layouts trained and were timed against the one-device run
        assert [r["layout"] for r in report["rows"]] == ["1", "mesh"] and all(r["steps"] == 3 for r in report["rows"])
        assert report["rows"][1]["throughput_vs_1"] > 0, report["rows"]
        assert [r["grpc_error_lines"] for r in report["rows"]] == [0, 0], report["rows"]
    if module == "devtools.decode_profile":  # per batch: the step without the profiler, GPU busy and idle in it
        batches = [b for r in report for b in r["batches"]]
        assert len(batches) == 2 and all(r["lora_rank"] == 2 for r in report), report
        assert all(b["wall_step_us"] > 0 and b["idle_us"] == b["wall_step_us"] - b["busy_us"] for b in batches), batches
    if module == "grpo_step:dapo":
        rows = report["results"]
        assert rows, report
        assert all(r["kept_same"] for r in rows), rows  # float32 on the CPU: the same samples


def _tp_only_worker(out_path: str, smoke_out_path: str) -> None:
    """On 2 forced CPU devices (this file run as a script): `random_params` on a (1, 2) mesh against
    the default device's, bf16 and nvfp4, then data_parallel's tp-only mode (--max-devices 0), then
    its --tiny smoke (one device's row and the tensor-parallel row; in this process, which has
    compiled the tensor-parallel row's programs already)."""
    import jax
    import numpy as np

    from benchmarks import common, data_parallel
    from qerl_jax import sharding

    config, mesh = common.model_config("tiny"), sharding.make_mesh(1, 2)
    result = {"devices": jax.device_count()}
    for quant in ("bf16", "nvfp4"):
        ref = common.random_params(config, quant=quant)
        got = common.random_params(config, quant=quant, mesh=mesh)
        pairs = list(zip(jax.tree.leaves(ref), jax.tree.leaves(got)))
        want = jax.tree.leaves(sharding.param_shardings(ref, mesh, "tp"))
        layers = got["base"]["layers"]
        pieces = jax.tree.leaves([layers["q_proj"]["w"], layers["down_proj"]["w"], got["base"]["embed"]])
        result[quant] = {
            "same_tree": jax.tree.structure(ref) == jax.tree.structure(got),
            "equal": all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs),
            "tp_shardings": all(y.sharding.is_equivalent_to(s, y.ndim) for (_, y), s in zip(pairs, want)),
            "split": [not x.sharding.is_fully_replicated for x in pieces if x.ndim > 1],  # not global_scale [L]
        }
    data_parallel.main(["--tiny", "--max-devices", "0", "--model-shards", "2", "--out", out_path])
    data_parallel.main(["--tiny", "--model-shards", "2", "--max-devices", "1", "--out", smoke_out_path])
    print(json.dumps(result))


def test_random_params_on_a_mesh_tp_only_mode_and_tiny_mode(tmp_path):
    """random_params(mesh=...) makes the same values in the tp shardings, `data_parallel
    --max-devices 0 --model-shards 2` reports the tp row alone, against itself, and data_parallel's
    --tiny smoke runs (one process for the three: a second process for the smoke compiled the same
    programs again). The smoke's two CPU devices give one device's row and the tensor-parallel row,
    which run every function of the benchmark but the one-call baseline's branch; the data-parallel
    paths on 2 devices are the library's, tested in test_sharding and test_train (all five rows took
    66 s, these two 19 s)."""
    out, smoke_out = tmp_path / "dp.json", tmp_path / "dp_tiny.json"
    env = two_device_env(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), str(out), str(smoke_out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    for quant in ("bf16", "nvfp4"):
        r = result[quant]
        assert r["same_tree"] and r["equal"] and r["tp_shardings"] and r["split"] and all(r["split"]), (quant, r)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["path"], r["devices"]) for r in rows] == [("tp", 2)], rows
    assert rows[0]["step_speedup"] == rows[0]["throughput_vs_1"] == 1.0 and rows[0]["tokens_equal_1"], rows
    smoke = json.loads(smoke_out.read_text())
    assert smoke and not _error_rows(smoke), _error_rows(smoke)  # every case ran (no error row)
    # the tensor-parallel row samples one device's tokens
    assert [r["tokens_equal_1"] for r in smoke["rows"] if r["path"] == "tp"] == [True], smoke["rows"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-devices", "0"],
        ["--max-devices", "0", "--model-shards", "1"],
        ["--max-devices", "-1"],
        ["--max-devices", "0", "--model-shards", "64"],  # more than the visible devices
    ],
)
def test_data_parallel_rejects_bad_device_counts(argv, capsys):
    from benchmarks import data_parallel

    with pytest.raises(SystemExit) as exc:
        data_parallel.main(["--tiny", *argv])
    assert exc.value.code == 2 and "--max-devices" in capsys.readouterr().err


if __name__ == "__main__":
    _tp_only_worker(sys.argv[1], sys.argv[2])
