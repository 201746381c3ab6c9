"""JAX's persistent compilation cache in a run's workdir, switched on by the training and eval
entry points (never at import time of the library).

The compiled programs (the rollout's admission and decode programs take 30-120 s each at 7B-32B)
and XLA's GPU autotuning results are written to <workdir>/jax_cache, so a resumed run, an eval
after training and a second run of the same config load them instead of compiling again.
"""

from __future__ import annotations

import os

import jax

CACHE_SUBDIR = "jax_cache"


def enable_compilation_cache(workdir: str, min_compile_seconds: float = 1.0) -> str:
    """Points JAX's persistent compilation cache at <workdir>/jax_cache (created); returns the path.

    Programs that took at least `min_compile_seconds` to compile are stored. Call it before the
    process compiles anything: JAX settles whether the cache is used at its first compilation.
    """
    path = os.path.join(os.path.abspath(workdir), CACHE_SUBDIR)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
