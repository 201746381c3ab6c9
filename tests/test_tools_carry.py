"""tools/carry: an experiment directory packed into small parts, checked and unpacked elsewhere."""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.checkpoint import Checkpointer, saved_steps
from tools import carry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("runs/bf16/seed0", "runs/nvfp4/seed1")
FINISHED = "runs/bf16/seed1"  # evaluated at its latest checkpoint: nothing to continue
PART_MIB = 2000 / carry.MIB  # 2000-byte parts: many parts, several batches


def _state(run: int, step: int) -> dict:
    rng = np.random.default_rng(100 * run + step)
    return {"lora": {"a": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}, "mu": jnp.asarray(rng.normal(size=(8,)))}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """A fake launcher --out: two runs with real orbax checkpoints at steps 5 and 10, logs, cache."""
    out = str(tmp_path_factory.mktemp("src") / "qg")
    for i, run in enumerate(RUNS):
        ckpt = Checkpointer(os.path.join(out, run, "checkpoints"))
        for step in (5, 10):
            ckpt.save(step, _state(i, step), {"step": step, "loader": {"epoch": 0}})
        ckpt.close()
        checkpoints = os.path.join(out, run, "checkpoints")
        os.makedirs(os.path.join(checkpoints, "15.orbax-checkpoint-tmp-1234567"))  # killed inside a save
        open(os.path.join(checkpoints, "15.orbax-checkpoint-tmp-1234567", "junk"), "w").write("x")
        os.makedirs(os.path.join(checkpoints, "12.unreadable"))
        os.makedirs(os.path.join(out, run, "tensorboard"))
        open(os.path.join(out, run, "tensorboard", "scalars.jsonl"), "w").write('{"step": 9, "aqn/sigma": 0}\n')
        os.makedirs(os.path.join(out, run, "adapter"))
        open(os.path.join(out, run, "adapter", "adapter_model.safetensors"), "wb").write(b"\0" * 5000)
        os.makedirs(os.path.join(out, run, "eval", "step_5"))  # an evaluation along the way
        open(os.path.join(out, run, "eval", "step_5", "summary.json"), "w").write("{}")
    os.makedirs(os.path.join(out, FINISHED, "checkpoints", "20"))  # a finished, evaluated run
    os.makedirs(os.path.join(out, FINISHED, "eval", "step_20"))
    open(os.path.join(out, FINISHED, "eval", "step_20", "summary.json"), "w").write('{"acc": 1}')
    os.makedirs(os.path.join(out, "jax_cache"))
    open(os.path.join(out, "jax_cache", "blob"), "wb").write(b"\1" * 5000)
    os.makedirs(os.path.join(out, "logs"))
    open(os.path.join(out, "logs", "bf16_seed0.log"), "w").write("step 10\n")
    for name in ("experiment.json", "commands.txt", "calls.jsonl"):
        open(os.path.join(out, name), "w").write("{}\n")
    return out


def _cli(*args):
    r = subprocess.run([sys.executable, "-m", "tools.carry", *args], capture_output=True, text=True, cwd=REPO)
    return r.returncode, r.stdout + r.stderr


def _pack_all(out, dest_root):
    """Every batch into its own folder (as separate calls bring them back); returns the folders."""
    tiny = ("--part-mib", str(PART_MIB), "--files", "4")
    folders, batches = [], 1
    while len(folders) < batches:
        folder = os.path.join(dest_root, f"b{len(folders)}")
        code, text = _cli("pack", "--src", out, "--dest", folder, "--batch", str(len(folders)), *tiny)
        assert code == 0, text
        batches = json.load(open(os.path.join(folder, carry.MANIFEST)))["batches"]
        assert f"{batches} batches in all" in text
        folders.append(folder)
    return folders


def _gather(folders, into):
    os.makedirs(into)
    for folder in folders:
        for name in os.listdir(folder):
            os.replace(os.path.join(folder, name), os.path.join(into, name))
    return into


def test_latest_step_matches_the_checkpointer(out):
    for run in RUNS:
        d = os.path.join(out, run, "checkpoints")
        assert carry.latest_step(d) == Checkpointer(d).latest_step() == saved_steps(d)[-1] == 10


def test_pack_unpack_round_trip_keeps_only_the_latest_step(out, tmp_path):
    folders = _pack_all(out, str(tmp_path / "calls"))
    assert len(folders) >= 3
    for folder in folders:  # what one call may bring back
        names = os.listdir(folder)
        sizes = [os.path.getsize(os.path.join(folder, n)) for n in names]
        assert len(names) <= 4 and carry.MANIFEST in names
        assert all(carry.NAME_OK.match(n) and os.path.isfile(os.path.join(folder, n)) for n in names)
        assert max(sizes) <= 16 * carry.MIB and sum(sizes) <= 64 * carry.MIB
    parts = _gather(folders, str(tmp_path / "parts"))
    dest = str(tmp_path / "next" / "qg")
    code, text = _cli("unpack", "--parts", parts, "--dest", dest)
    assert code == 0, text
    assert not os.path.exists(os.path.join(parts, carry.TAR))  # the joined tar is removed
    for i, run in enumerate(RUNS):
        checkpoints = os.path.join(dest, run, "checkpoints")
        assert os.listdir(checkpoints) == ["10"]
        ckpt = Checkpointer(checkpoints)
        assert ckpt.latest_step() == 10
        state, meta = ckpt.restore(None, like=_state(i, 10))
        assert meta["step"] == 10
        np.testing.assert_array_equal(np.asarray(state["lora"]["a"]), np.asarray(_state(i, 10)["lora"]["a"]))
        np.testing.assert_array_equal(np.asarray(state["mu"]), np.asarray(_state(i, 10)["mu"]))
        assert open(os.path.join(dest, run, "tensorboard", "scalars.jsonl")).read() == '{"step": 9, "aqn/sigma": 0}\n'
        assert os.path.isfile(os.path.join(dest, run, "eval", "step_5", "summary.json"))
        assert not os.path.exists(os.path.join(dest, run, "adapter"))
    assert os.listdir(os.path.join(dest, FINISHED, "checkpoints")) == []  # finished: its state stays behind
    assert open(os.path.join(dest, FINISHED, "eval", "step_20", "summary.json")).read() == '{"acc": 1}'
    assert open(os.path.join(dest, "jax_cache", "blob"), "rb").read() == b"\1" * 5000  # compiles saved
    assert sorted(os.listdir(dest)) == ["calls.jsonl", "commands.txt", "experiment.json", "jax_cache", "logs", "runs"]


def test_the_cached_tar_is_reused_and_rebuilt_when_the_source_changes(out, tmp_path):
    out = shutil.copytree(out, tmp_path / "qg", ignore=shutil.ignore_patterns(carry.CACHE))
    code, first = _cli("pack", "--src", out, "--dest", str(tmp_path / "a"), "--batch", "0")
    assert code == 0 and "rebuilding" not in first
    tar = os.path.join(out, carry.CACHE, carry.TAR)
    built = os.stat(tar).st_mtime_ns
    code, again = _cli("pack", "--src", out, "--dest", str(tmp_path / "b"), "--batch", "0")
    assert code == 0 and os.stat(tar).st_mtime_ns == built
    assert "1 batches in all" in again  # 15 MiB parts: one part
    with open(os.path.join(out, "logs", "bf16_seed0.log"), "a") as f:
        f.write("step 11\n")
    code, text = _cli("pack", "--src", out, "--dest", str(tmp_path / "c"), "--batch", "0")
    assert code == 0 and "rebuilding" in text


@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_a_damaged_or_missing_part_extracts_nothing(out, tmp_path, fault):
    parts = _gather(_pack_all(out, str(tmp_path / "calls")), str(tmp_path / "parts"))
    victim = "carry.part0002"
    if fault == "corrupt":
        data = bytearray(open(os.path.join(parts, victim), "rb").read())
        data[100] ^= 1
        open(os.path.join(parts, victim), "wb").write(bytes(data))
    else:
        os.remove(os.path.join(parts, victim))
    dest = str(tmp_path / "qg")
    code, text = _cli("unpack", "--parts", parts, "--dest", dest)
    assert code == 2
    assert len(text.strip().splitlines()) == 1 and victim in text and "Traceback" not in text
    assert ("damaged" if fault == "corrupt" else "missing") in text
    assert not os.path.exists(dest) and not os.path.exists(os.path.join(parts, carry.TAR))


def _manifest_of(tar_bytes: bytes, into) -> None:
    """`into` holds one part and a manifest that matches it (a hostile but consistent pack)."""
    os.makedirs(into)
    open(os.path.join(into, "carry.part0000"), "wb").write(tar_bytes)
    sha = hashlib.sha256(tar_bytes).hexdigest()
    manifest = {"tar_sha256": sha, "parts": [{"name": "carry.part0000", "bytes": len(tar_bytes), "sha256": sha}]}
    json.dump(manifest, open(os.path.join(into, carry.MANIFEST), "w"))


@pytest.mark.parametrize("member", ["../escape.txt", "/tmp/abs.txt", "link"])
def test_unpack_refuses_members_outside_the_destination(tmp_path, member):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(member)
        if member == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    parts = str(tmp_path / "parts")
    _manifest_of(buf.getvalue(), parts)
    dest = str(tmp_path / "d" / "qg")
    code, text = _cli("unpack", "--parts", parts, "--dest", dest)
    assert code == 2 and "refusing" in text and len(text.strip().splitlines()) == 1
    assert not os.path.exists(dest) and not os.path.exists(str(tmp_path / "d" / "escape.txt"))


@pytest.mark.parametrize(
    "args, says",
    [
        (["pack", "--src", "/nonexistent/qg", "--dest", "x", "--batch", "0"], "--src /nonexistent/qg"),
        (["pack", "--src", ".", "--dest", "x", "--batch", "0", "--part-mib", "0"], "--part-mib 0"),
        (["pack", "--src", ".", "--dest", "x", "--batch", "0", "--files", "1"], "--files 1"),
        (["pack", "--src", ".", "--dest", "x", "--batch", "0", "--part-mib", "70"], "--batch-mib 64.0: no room"),
        (["unpack", "--parts", "/nonexistent", "--dest", "x"], carry.MANIFEST),
    ],
)
def test_bad_input_is_one_line(args, says, tmp_path):
    code, text = _cli(*args)
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1


def test_batch_past_the_last_and_a_nonempty_destination_are_refused(out, tmp_path):
    code, text = _cli("pack", "--src", out, "--dest", str(tmp_path / "x"), "--batch", "7")
    assert code == 2 and "there are 1 batches" in text
    assert not os.path.exists(tmp_path / "x")
    _cli("pack", "--src", out, "--dest", str(tmp_path / "p"), "--batch", "0")
    code, text = _cli("unpack", "--parts", str(tmp_path / "p"), "--dest", out)
    assert code == 2 and "not empty" in text
