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
from conftest import REPO

CASES = {
    "grpo_step": [],
    "grpo_step:dapo": ["--workload", "dapo"],  # its cases must run without an error row
    "train_step": [],
    "scale": [],
    # Two CPU devices (below): one device's row and the tensor-parallel row, which run every function
    # of the benchmark but the one-call baseline's branch; the data-parallel paths on 2 devices are the
    # library's, tested in test_sharding and test_train (all five rows here took 66 s, these two 19 s).
    "data_parallel": ["--model-shards", "2", "--max-devices", "1"],
    "real_run": ["--gpus", "2", "--layouts", "1", "mesh"],  # the main job itself, 1 and 2 CPU devices
    "devtools.decode_profile": ["--prompt-len", "16", "--cache-new-tokens", "32"],  # its documented CPU smoke sizes
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
    if module == "data_parallel":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    name = module.split(":")[0]
    extra = ["--workdir", str(tmp_path / "runs")] if name == "real_run" else []
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--tiny", "--out", str(out), *CASES[module], *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report and not _error_rows(report), _error_rows(report)  # every case ran (no child's error row)
    if module == "data_parallel":  # the tensor-parallel row samples one device's tokens
        assert [r["tokens_equal_1"] for r in report["rows"] if r["path"] == "tp"] == [True], report["rows"]
    if module == "real_run":  # both layouts trained and were timed against the one-device run
        assert [r["layout"] for r in report["rows"]] == ["1", "mesh"] and all(r["steps"] == 3 for r in report["rows"])
        assert report["rows"][1]["throughput_vs_1"] > 0, report["rows"]
    if module == "grpo_step:dapo":
        rows = report["results"]
        assert rows, report
        assert all(r["kept_same"] for r in rows), rows  # float32 on the CPU: the same samples
