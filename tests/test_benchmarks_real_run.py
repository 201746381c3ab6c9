"""benchmarks/real_run: the layouts' commands and the summary of a run's own scalars."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from benchmarks import real_run


def _args(**kw):
    base = dict(config="configs/tiny.py", model="m.gguf", gpus=4, steps=5, seed=1, tiny=False)
    return argparse.Namespace(**{**base, **kw})


def test_each_layout_runs_the_recipe_on_its_devices(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    one = real_run.commands("1", _args(), "/w/1")
    assert len(one) == 1 and one[0][0] == {"CUDA_VISIBLE_DEVICES": "0"}
    argv = one[0][1]
    assert "--config=configs/tiny.py" in argv and "--config.model.path=m.gguf" in argv
    assert (
        "--config.train.total_steps=5" in argv and "--config.seed=1" in argv and "--config.eval.num_examples=0" in argv
    )
    mesh = real_run.commands("mesh", _args(), "/w/m")
    assert mesh[0][0] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"} and "--config.mesh.data=4" in mesh[0][1]
    weak = real_run.commands("weak", _args(), "/w/w")[0][1]
    assert "--config.rollout.prompts_per_step=16" in weak  # the tiny recipe's 4 prompts x 4
    assert "--config.mesh.model=4" in real_run.commands("tp", _args(), "/w/t")[0][1]
    procs = real_run.commands("procs", _args(), "/w/p")
    assert [env["QERL_PROCESS_ID"] for env, _ in procs] == ["0", "1", "2", "3"]
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in procs] == ["0", "1", "2", "3"]
    assert len({env["JAX_COORDINATOR_ADDRESS"] for env, _ in procs}) == 1
    cpu = real_run.commands("mesh", _args(tiny=True, gpus=2), "/w/c")[0][0]
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2" and cpu["JAX_PLATFORMS"] == "cpu"
    partial = _args(overrides=["rollout.max_staleness=1"])
    for layout in ("1", "weak", "procs"):  # every process of every layout
        assert all("--config.rollout.max_staleness=1" in argv for _, argv in real_run.commands(layout, partial, "/w"))


def test_tiny_layouts_keep_the_environment_s_other_xla_flags(monkeypatch):
    """They share compiled programs with other commands of the same flags (the tests' tiny runs)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=1 --xla_force_host_platform_device_count=8")
    mesh = real_run.commands("mesh", _args(tiny=True, gpus=2), "/w/c")[0][0]
    assert mesh["XLA_FLAGS"] == "--xla_backend_optimization_level=1 --xla_force_host_platform_device_count=2"
    one = real_run.commands("1", _args(tiny=True, gpus=2), "/w/1")[0][0]
    assert one["XLA_FLAGS"] == "--xla_backend_optimization_level=1"  # one device: the CPU's own count


def test_summary_sets_step_zero_apart_and_counts_kept_completions(tmp_path):
    os.makedirs(tmp_path / "tensorboard")
    rows = [
        {"step": 0, "time/step_s": 30.0, "time/rollout_s": 20.0, "time/train_s": 9.0, "rollout/groups_kept": 4},
        {"step": 0, "reward/mean": 0.5},  # another row of step 0's scalars
        {"step": 1, "time/step_s": 2.0, "time/rollout_s": 1.5, "time/train_s": 0.5, "rollout/groups_kept": 4,
         "rollout/response_length_max": 30},
        {"step": 2, "time/step_s": 4.0, "time/rollout_s": 3.0, "time/train_s": 1.0, "rollout/groups_kept": 2,
         "rollout/response_length_max": 10},
    ]  # fmt: skip
    (tmp_path / "tensorboard" / "scalars.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = real_run.summarize(str(tmp_path), group_size=4)
    assert s["steps"] == 3 and s["step0_s"] == 30.0
    assert s["step_s"] == pytest.approx(3.0) and s["rollout_median_s"] == pytest.approx(2.25)
    assert s["completions_per_s"] == pytest.approx((4 + 2) * 4 / 6.0)
    assert s["longest_mean"] == pytest.approx(20.0)
    assert math.isnan(s["offpolicy_tokens_frac"]) and s["staleness_max"] == 0.0  # on-policy: not logged
    assert real_run.summarize(str(tmp_path / "none"), group_size=4) == {"steps": 0}


def _write_run(workdir, rollout_s, reward_s, step_s, **more):
    os.makedirs(workdir / "tensorboard")
    rows = [{"step": s, "time/step_s": t, "time/rollout_s": r, "time/reward_s": w, "time/train_s": 1.0, **more}
            for s, (r, w, t) in enumerate(zip(rollout_s, reward_s, step_s))]  # fmt: skip
    (workdir / "tensorboard" / "scalars.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_compare_gives_finished_runs_as_ratios_of_the_first(tmp_path, capsys):
    _write_run(tmp_path / "ref", [9.0, 6.0, 7.0, 8.0], [0.0, 1.0, 0.0, 0.5], [20.0, 10.0, 10.0, 12.0])
    _write_run(tmp_path / "new", [9.0, 4.0, 3.0, 5.0], [0.0, 0.0, 0.0, 0.0], [20.0, 8.0, 7.0, 9.0],
               **{"rollout/tokens_per_s": 100.0, "rollout/unused_tokens_frac": 0.25,
                  "rollout/offpolicy_tokens_frac": 0.3, "rollout/staleness_max": 1.0,
                  "rollout/decode_steps": 600.0, "time/rollout_loop_host_s": 0.5})  # fmt: skip
    s = real_run.summarize(str(tmp_path / "ref"), group_size=4)
    assert s["rollout_reward_s"] == pytest.approx(7.5) and s["rollout_reward_median_s"] == pytest.approx(7.0)
    assert s["finished_tokens"] == 0.0 and math.isnan(s["unused_tokens_frac"])
    new = real_run.summarize(str(tmp_path / "new"), group_size=4)
    assert new["finished_tokens"] == pytest.approx(400.0) and new["unused_tokens_frac"] == pytest.approx(0.25)
    assert new["offpolicy_tokens_frac"] == pytest.approx(0.3) and new["staleness_max"] == 1.0
    assert new["decode_steps"] == 600.0 and math.isnan(s["decode_steps"])
    assert new["rollout_loop_host_s"] == 0.5 and math.isnan(new["rollout_loop_device_s"])
    assert real_run.main(["--compare", str(tmp_path / "ref"), str(tmp_path / "new")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[-2:] == [f"{4.0 / 7.5:.2f}/{4.0 / 7.0:.2f}", f"{8.0 / (32 / 3):.2f}/{8.0 / 10.0:.2f}"]
    with pytest.raises(SystemExit) as e:
        real_run.main(["--compare", str(tmp_path / "ref"), str(tmp_path / "missing")])
    assert e.value.code == 2 and "--compare" in capsys.readouterr().err


def test_an_existing_layout_workdir_is_refused_before_any_run(tmp_path, capsys):
    os.makedirs(tmp_path / "1")
    with pytest.raises(SystemExit) as e:
        real_run.main(["--tiny", "--layouts", "1", "--workdir", str(tmp_path)])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        real_run.main(["--gpus", "1", "--layouts", "1", "mesh", "--workdir", str(tmp_path / "x")])
    assert e.value.code == 2
