"""JAX's persistent compilation cache, shared by every run and command of a user, switched on by the
training and eval entry points (never at import time of the library).

The compiled programs (the rollout's admission and decode programs take 30-120 s each at 7B-32B;
NVFP4's Pallas kernels double the 1.5B's compile time) and XLA's GPU autotuning results are written
to one directory, by default `$XDG_CACHE_HOME/qerl_jax/jax_cache` (`~/.cache/...`), so a resumed
run, an eval after training and a second run of the same config in a new workdir load them instead
of compiling again. What it cannot hold: the Mosaic GPU (wgmma) kernels, which jaxlib compiles when a
program loads, in every process; small models (`rollout.weights.KERNEL_MIN_LAYER_WEIGHTS`) do not
run them by default. The directory is bounded (least recently used entries go first) and written
under a file lock, so runs side by side can share it.
"""

from __future__ import annotations

import os

import jax

from qerl_jax.model_io.load_cache import usable_cache_dir

# Bound of the shared directory: the programs of a few model sizes and batch shapes.
MAX_BYTES = 8 * 2**30
# What source paths in compiled programs lose: everything before the package (or site-packages)
# directory. JAX strips debug locations from a program before hashing it into a cache key, but not
# from the Triton kernels Pallas embeds in it (their IR names each op's file), so without this an
# NVFP4 program's key would change with the checkout's absolute path, e.g. on every GPU machine.
SOURCE_PREFIX_REGEX = r".*/(?=(qerl_jax|pallas_kernels|benchmarks|experiments|configs)/)|.*/site-packages/"


def user_cache_dir(name: str) -> str:
    """`$XDG_CACHE_HOME/qerl_jax/<name>`, `~/.cache/qerl_jax/<name>` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qerl_jax", name)


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/qerl_jax/jax_cache`, `~/.cache/qerl_jax/jax_cache` without it."""
    return user_cache_dir("jax_cache")


def cache_dir(configured: str, name: str = "jax_cache") -> str:
    """The directory a config's cache field names ("" = `user_cache_dir(name)`), absolute: `compile_cache_dir`
    (JAX's programs, "jax_cache") or `model.cache_dir` (converted GGUF models, `model_io.load_cache.CACHE_NAME`)."""
    return os.path.abspath(os.path.expanduser(configured) if configured else user_cache_dir(name))


# Programs that compile faster than this are not stored by default (loading them would save little).
MIN_COMPILE_SECONDS = 1.0
# A user's own threshold, as JAX spells it in the environment, is kept (the tests store every program).
MIN_COMPILE_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Likewise a user's own bound (-1: unbounded; the tests' directory lives only as long as their run, and
# a bound costs a scan of the whole directory per stored program).
MAX_BYTES_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"


def enable_compilation_cache(
    directory: str, min_compile_seconds: float | None = None, max_bytes: int | None = None
) -> str | None:
    """Points JAX's persistent compilation cache at `directory` (created); returns its absolute path.

    Programs that took at least `min_compile_seconds` to compile are stored (None: the environment's
    $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS if set, else `MIN_COMPILE_SECONDS`); past `max_bytes`
    (None: $JAX_COMPILATION_CACHE_MAX_SIZE if set, else `MAX_BYTES`) the least recently used entries
    are evicted; source paths in programs are made relative (`SOURCE_PREFIX_REGEX`), so keys do not
    depend on where the checkout lies. Call it before the process compiles anything: JAX settles
    whether the cache is used at its first compilation. A directory that cannot be made or written
    (a file, no permission) leaves the cache off with one line on stderr: it only saves time.
    Returns None then.
    """
    path = usable_cache_dir(directory, "compilation cache")
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if min_compile_seconds is None:
        min_compile_seconds = float(os.environ.get(MIN_COMPILE_SECONDS_ENV) or MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    if max_bytes is None:
        max_bytes = int(os.environ.get(MAX_BYTES_ENV) or MAX_BYTES)
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    if jax.config.jax_hlo_source_file_canonicalization_regex is None:  # a user's own setting stays
        jax.config.update("jax_hlo_source_file_canonicalization_regex", SOURCE_PREFIX_REGEX)
    return path
