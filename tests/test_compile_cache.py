"""qerl_jax.compile_cache: a second process loads the first one's compiled programs from the workdir."""

import json
import os
import subprocess
import sys

from conftest import REPO

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


def _run(workdir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", SCRIPT, workdir], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_program_from_the_workdir(tmp_path):
    first = _run(str(tmp_path / "run"))
    assert first["path"] == str(tmp_path / "run" / "jax_cache") and first["hits"] == 0
    assert os.listdir(first["path"])  # the compiled program was written
    second = _run(str(tmp_path / "run"))
    assert second["hits"] >= 1  # and read back instead of compiled
