"""experiments/launcher: processes spread over GPUs, and one source tree per experiment."""

import argparse
import json
import os

import pytest

from experiments import launcher
from experiments.aqn_dose.run import EXPERIMENT as DOSE
from experiments.qwen_gsm8k.run import EXPERIMENT as CLAIMS


def test_processes_go_to_the_least_busy_gpu_and_share_its_memory():
    placed = []
    for _ in range(8):
        placed.append(launcher.least_busy_gpu(placed, 4))
    assert placed == [0, 1, 2, 3, 0, 1, 2, 3]
    assert launcher.least_busy_gpu([0, 0, 1, 2, 3, 3], 4) == 1  # a slot freed on GPU 1
    assert launcher.mem_fraction(8, 4, 0.45) == pytest.approx(0.4)  # two processes a GPU
    assert launcher.mem_fraction(9, 4, 0.45) == pytest.approx(0.8 / 3)
    assert launcher.mem_fraction(3, 1, 0.45) == pytest.approx(0.8 / 3)  # one GPU: as before
    assert launcher.mem_fraction(1, 1, 0.45) == pytest.approx(0.45)


def _tree(root, files):
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        open(os.path.join(root, rel), "w").write(text)
    return str(root)


def test_code_hash_follows_the_sources_a_run_computes_with(tmp_path):
    files = {"qerl_jax/a.py": "x = 1\n", "configs/c.py": "y = 2\n", "experiments/launcher.py": "z\n"}
    a = launcher.code_sha256(_tree(tmp_path / "a", files))
    assert a == launcher.code_sha256(_tree(tmp_path / "b", {**files, "README.md": "other", "qerl_jax/n.txt": "x"}))
    assert a != launcher.code_sha256(_tree(tmp_path / "c", {**files, "qerl_jax/a.py": "x = 2\n"}))
    assert a != launcher.code_sha256(_tree(tmp_path / "d", {**files, "pallas_kernels/k.py": ""}))


def test_an_experiment_records_its_tree_and_one_with_same_code_refuses_another(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    out = tmp_path / "out"
    args = argparse.Namespace(out=str(out), steps=180, tiny=False, gguf=str(gguf))
    code = launcher._check_experiment_file(DOSE, args)
    assert json.load(open(out / "experiment.json"))["code"] == code == launcher.code_sha256()
    assert launcher._check_experiment_file(DOSE, args) == code  # the same tree again: accepted
    record = json.load(open(out / "experiment.json"))
    json.dump({**record, "code": "0" * 64}, open(out / "experiment.json", "w"))
    assert launcher._check_experiment_file(CLAIMS, args) == code  # no same_code: recorded per call only
    with pytest.raises(SystemExit) as e:
        launcher.main(DOSE, "", ["--gguf", str(gguf), "--out", str(out), "--seeds", "0", "1", "--gpus", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "records the source tree 000000000000" in err and err.count("\n") == 1
    assert not (out / "commands.txt").exists() and not (out / "logs").exists()
    worker = ["--worker", "train", "--arm", "sigma0", "--seed", "0", "--gguf", str(gguf), "--out", str(out), "--deadline", "0"]
    with pytest.raises(SystemExit) as e:  # a worker started later in a call checks the tree too
        launcher.main(DOSE, "", worker)
    assert e.value.code == 2 and "records the source tree" in capsys.readouterr().err
    assert not (out / "runs").exists()


def test_bad_gpu_count_is_one_line(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        launcher.main(DOSE, "", ["--gguf", str(gguf), "--out", str(tmp_path / "o"), "--gpus", "0"])
    assert e.value.code == 2 and "--gpus 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
