"""qerl_jax.compile_cache: a second process loads the first one's compiled programs; runs share one
directory by default, so a second run of a config in a new workdir starts warm."""

import json
import os
import subprocess
import sys

from conftest import REPO

from qerl_jax import compile_cache

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from qerl_jax.compile_cache import enable_compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
path = enable_compilation_cache(sys.argv[1], min_compile_seconds=0.0)
f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T + 1.0)
f(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"path": path, "hits": len(hits)}))
"""


def _run(directory):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", SCRIPT, directory], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_program(tmp_path):
    first = _run(str(tmp_path / "cache"))
    assert first["path"] == str(tmp_path / "cache") and first["hits"] == 0
    assert any(not name.startswith(".") for name in os.listdir(first["path"]))  # the program was written
    second = _run(str(tmp_path / "cache"))
    assert second["hits"] >= 1  # and read back instead of compiled


def test_runs_share_the_user_cache_unless_the_config_names_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shared = str(tmp_path / "xdg" / "qerl_jax" / "jax_cache")
    assert compile_cache.default_cache_dir() == shared
    assert compile_cache.cache_dir("") == shared  # the default config: every workdir the same directory
    assert compile_cache.cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_cache_dir() == str(tmp_path / "home" / ".cache" / "qerl_jax" / "jax_cache")


def test_a_directory_that_cannot_be_used_leaves_the_cache_off_with_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    before = compile_cache.jax.config.jax_compilation_cache_dir
    assert compile_cache.enable_compilation_cache(str(blocker / "cache")) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compilation cache off: cannot use ") and "a_file" in err[0]
    assert compile_cache.jax.config.jax_compilation_cache_dir == before  # nothing switched on


THRESHOLDS = """
import json, os, sys
from qerl_jax import compile_cache
seen = []
for env_values, given in ((("0.25", "-1"), (None, None)), (("0.25", "-1"), (2.0, 3)), (("", ""), (None, None))):
    os.environ[compile_cache.MIN_COMPILE_SECONDS_ENV], os.environ[compile_cache.MAX_BYTES_ENV] = env_values
    compile_cache.enable_compilation_cache(sys.argv[1], *given)
    config = compile_cache.jax.config
    seen.append([config.jax_persistent_cache_min_compile_time_secs, config.jax_compilation_cache_max_size])
print(json.dumps(seen))
"""


def test_a_minimum_compile_time_and_size_bound_set_in_the_environment_are_kept_unless_given(tmp_path):
    """$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS and $JAX_COMPILATION_CACHE_MAX_SIZE (how the tests store
    every program, unbounded) stay in force; an explicit `min_compile_seconds` or `max_bytes` wins;
    without either, MIN_COMPILE_SECONDS and MAX_BYTES."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    cmd = [sys.executable, "-c", THRESHOLDS, str(tmp_path / "cache")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = [[0.25, -1], [2.0, 3], [compile_cache.MIN_COMPILE_SECONDS, compile_cache.MAX_BYTES]]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


LOWER_NVFP4 = """
import json, sys
import jax, jax.numpy as jnp
from qerl_jax.compile_cache import enable_compilation_cache
from qerl_jax.quant import quantize
import pallas_kernels
from pallas_kernels.quant_matmul import nvfp4_matmul
if sys.argv[2] == "cache":
    enable_compilation_cache(sys.argv[1])
w = quantize(jnp.ones((256, 512), jnp.bfloat16), "nvfp4")
f = jax.jit(lambda x, w: nvfp4_matmul(x, w, interpret=False))
text = f.trace(jnp.ones((16, 512), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
print(json.dumps({"absolute": pallas_kernels.__file__.rsplit("/", 1)[0] in text,
                  "relative": "pallas_kernels/quant_matmul.py" in text}))
"""


def test_kernel_programs_do_not_name_the_checkout_path(tmp_path):
    """The Triton kernel inside an NVFP4 program (lowered for the GPU, here on the CPU) names its source
    file; with the cache on that name is relative, so the program's cache key is the same wherever
    the checkout lies (without it the key changed with the absolute path)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    seen = {}
    for mode in ("plain", "cache"):
        cmd = [sys.executable, "-c", LOWER_NVFP4, str(tmp_path / "cache"), mode]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["plain"]["absolute"]  # what JAX's own cache key would hash
    assert seen["cache"] == {"absolute": False, "relative": True}
