"""benchmarks/rollout.py's launch census: the counts land on the rows of the backend they were
counted for, and a census that cannot run says why in one line."""

from __future__ import annotations

import argparse

from benchmarks import rollout as bench

CENSUS = {
    "rows": [
        {"format": "bf16", "rows": 16, "launches": 602, "by_kind": {"fusion": 349, "gemm": 225, "triton": 28}},
        {"format": "nvfp4", "rows": 16, "launches": 604, "by_kind": {"fusion": 351, "gemm": 225, "triton": 28}},
        {"format": "nvfp4", "rows": 128, "launches": 610, "by_kind": {"fusion": 357}},
    ]
}


def test_launches_land_on_the_rows_of_their_backend():
    rows = [
        {"format": "bf16", "backend": "xla", "batch": 16},
        {"format": "nvfp4", "backend": "pallas", "batch": 16},
        {"format": "nvfp4", "backend": "xla", "batch": 16},  # counted for "pallas" only
        {"format": "nvfp4", "backend": "pallas", "batch": 1},  # not counted
        {"format": "transformers", "backend": "torch", "batch": 16},
    ]
    bench.attach_launches(rows, CENSUS)
    assert [r.get("launches_per_step") for r in rows] == [602, 604, None, None, None]
    assert rows[1]["launches_by_kind"] == {"fusion": 351, "gemm": 225, "triton": 28}
    bench.attach_launches(rows, {"error": "no plugin"})  # nothing to attach: the rows keep what they had
    assert rows[0]["launches_per_step"] == 602


def test_a_census_that_cannot_run_reports_one_line(tmp_path, monkeypatch):
    """Without a compile-only CUDA device (no jax CUDA plugin, as on CI) the census returns its
    error instead of counts; the benchmark prints it and writes the rest."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(bench.sys, "executable", "/bin/false")  # a census subprocess that fails
    args = argparse.Namespace(tiny=True, batches="", model="7B", lora_rank=0, out=str(tmp_path / "out.json"))
    census = bench.launch_census(args, ["bf16", "nvfp4"], timeout=60)
    assert set(census) == {"error"} and census["error"].startswith("the census failed")
    assert bench.launch_census(args, ["mxfp4"], timeout=60) == {"error": "no bf16 or nvfp4 rows"}
