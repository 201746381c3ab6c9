"""experiments/paired_runs.py: two arms' per-step scalars paired by step, against numpy."""

import json
import os

import numpy as np
import pytest

from experiments import paired_runs


def _write(workdir, rows):
    os.makedirs(os.path.join(workdir, "tensorboard"))
    with open(paired_runs.scalars_file(str(workdir)), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(workdir)


def test_steps_are_paired_on_those_both_reached_and_a_resumed_step_counts_once(tmp_path):
    a = _write(tmp_path / "a", [{"step": t, "time/step_s": 1.0, "r": 0.1 * t} for t in range(6)]
               + [{"step": 5, "eval/x": 1.0}, {"step": 5, "time/step_s": 1.0, "r": 9.0}])  # fmt: skip
    b = _write(tmp_path / "b", [{"step": t, "time/step_s": 2.0, "r": 0.2 * t} for t in range(1, 5)])
    ra, rb = paired_runs.read_steps(a), paired_runs.read_steps(b)
    assert sorted(ra) == list(range(6)) and ra[5]["r"] == 9.0  # the eval row is not a step; the last row of 5 wins
    assert paired_runs.common_steps(ra, rb, 2, 10) == [2, 3, 4]
    d = paired_runs.paired_difference(ra, rb, "r", 0, 10)
    assert d["steps"] == 4 and d["value"] == pytest.approx(np.mean([0.1 * t for t in range(1, 5)]))
    assert paired_runs.mean_logged(ra, "r", 1, 4) == pytest.approx(0.25)
    assert paired_runs.mean_logged(ra, "missing") is None
