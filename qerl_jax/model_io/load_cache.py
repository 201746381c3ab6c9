"""A cache of converted GGUF models, shared by every run of a user.

Converting a GGUF file (parsing its metadata, dequantizing its k-quants with numpy, quantizing the
linears to NVFP4, building the tokenizer from the metadata) takes over a minute for a 1.5B model,
on every run. The converted form (the params pytree exactly as `loader.load_model` returns it,
the config, the tokenizer) is stored once per (file, dtype, quant, quant_skip) in
`<root>/<key>/` and read back by later runs:

    <key>/params.safetensors   every leaf by its tree path; the tree and the real dtypes
                               (bfloat16, float8_e4m3fn stored as same-width uint views) in its metadata
    <key>/config.json          `hf_layout.hf_config_dict` of the ModelConfig
    <key>/tokenizer*.json ...  `tokenizer.save_pretrained`

The key hashes the file's real path, size and mtime, so a changed file is converted again. An
entry is written into a temporary sibling and renamed into place under a file lock, so runs side by
side never read a half-written one (a second run of the same key waits for the first's conversion
and then reads it). The root is bounded (MAX_BYTES; least recently used entries go first). A
damaged entry is removed and converted again; a root that cannot be written leaves the cache off.
The cache only saves time: none of its problems stops a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from qerl_jax.model_io import gguf, loader
from qerl_jax.model_io.hf_layout import hf_config_dict, parse_config
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.quant.formats import DENSE
from qerl_jax.quant.packed import PackedWeight

# The root's name under the user's cache directory: `$XDG_CACHE_HOME/qerl_jax/models` (`~/.cache/...`),
# next to JAX's compilation cache (`compile_cache.cache_dir(cfg.model.cache_dir, CACHE_NAME)`).
CACHE_NAME = "models"
# Bumped whenever the stored form or what the converter produces changes: old entries then miss.
FORMAT_VERSION = 1
# Bound of the root: a few converted models (a 1.5B NVFP4 entry is ~1.3 GiB, a 7B ~5 GiB).
MAX_BYTES = 16 * 2**30
WEIGHTS_FILE = "params.safetensors"
CONFIG_FILE = "config.json"
_LOCK_FILE = ".lock"
_TMP_PREFIX = ".tmp-"
# The custom pytree nodes an entry may hold, by name (rebuilt from their fields, never unpickled).
_NODE_TYPES = {"PackedWeight": PackedWeight}
# Dtypes safetensors' numpy API stores as they are; others go as a same-width unsigned int view.
_NATIVE = {
    np.dtype(t) for t in "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64".split()
}


def cache_key(gguf_file: str, dtype: str, quant: str | None, quant_skip: tuple[str, ...]) -> str:
    """sha256 (hex) of what the converted form depends on: the file (path, size, mtime) and the options."""
    real = os.path.realpath(gguf_file)
    st = os.stat(real)
    fields = {
        "file": real,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
        "quant": None if quant in (None, DENSE) else quant,
        "quant_skip": sorted(quant_skip),
        "format_version": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def convert(model_dir: str, *, dtype: str, quant: str | None, quant_skip: tuple[str, ...]):
    """(config, params, tokenizer) of a checkpoint, converted by the loader (what the cache saves)."""
    config, params = loader.load_model(model_dir, dtype=dtype, quant=quant, quant_skip=quant_skip)
    return config, params, loader.load_tokenizer(model_dir)


def load_or_convert(
    model_dir: str,
    *,
    dtype: str,
    quant: str | None,
    quant_skip: tuple[str, ...] = (),
    root: str,
    max_bytes: int = MAX_BYTES,
) -> tuple[ModelConfig, dict[str, Any], Any]:
    """(config, params, tokenizer) of `model_dir`: a GGUF model's from the cache under `root` when
    stored there, else converted (and stored); any other checkpoint is loaded directly.

    params = {"base", "norms"} on the default device, as `loader.load_model` returns them.
    """
    file = gguf.find_gguf_file(model_dir)
    root = usable_cache_dir(root, "model cache") if file is not None else None
    if root is None:
        return convert(model_dir, dtype=dtype, quant=quant, quant_skip=quant_skip)
    key = cache_key(file, dtype, quant, quant_skip)
    entry = os.path.join(root, key)
    start = time.perf_counter()
    # Entries appear by an atomic rename, so a stored one is read without a lock (runs side by side
    # read it at once); a miss takes the key's lock: runs started together from one file wait for
    # the first one's conversion and then read it.
    hit = _read_entry(root, entry)
    if hit is None:
        with _locked(_key_lock(root, key)):
            hit = _read_entry(root, entry)
            if hit is None:
                config, params, tokenizer = convert(model_dir, dtype=dtype, quant=quant, quant_skip=quant_skip)
                _store(root, key, file, config, params, tokenizer, max_bytes)
                return config, params, tokenizer
    with contextlib.suppress(OSError):  # evicted meanwhile: the arrays are read already
        os.utime(entry)  # least recently used goes first
    print(
        f"model: loaded the converted {os.path.basename(file)} from the cache {entry} "
        f"({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    return hit


# ----------------------------------------------------------------------------- the directory


def usable_cache_dir(directory: str, name: str) -> str | None:
    """`directory` as an absolute path (created) when it can be written; else None, with one line
    on stderr saying the cache `name` is off (a cache only saves time). This cache's root and JAX's
    compilation cache (`compile_cache.enable_compilation_cache`) are checked by it."""
    path = os.path.abspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"not writable: {path}")
    except OSError as e:
        print(f"{name} off: cannot use {path} ({e.strerror or e})", file=sys.stderr)
        return None
    return path


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive `fcntl.flock` on `path` (created) for the block; released if the process dies."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _key_lock(root: str, key: str) -> str:
    return os.path.join(root, f".{key}.lock")


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _evict(root: str, max_bytes: int, keep: str) -> None:
    """Removes the least recently used entries (directory mtime) until the root holds at most `max_bytes`."""
    entries = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(".") and os.path.isdir(path):
            entries.append((os.stat(path).st_mtime_ns, _size(path), path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        if path == keep:
            continue
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(_key_lock(root, os.path.basename(path)))
        total -= size
        print(f"model cache: evicted {path} ({size / 2**30:.1f} GiB; the cache's bound is {max_bytes / 2**30:.1f} GiB)")


# ----------------------------------------------------------------------------- the params tree


def _flatten(tree: Any, path: str, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """The JSON description of `tree`; its arrays go into `tensors` by their '/'-joined path."""
    if isinstance(tree, dict):
        return {"dict": {k: _flatten(v, f"{path}/{k}" if path else k, tensors) for k, v in tree.items()}}
    if type(tree).__name__ in _NODE_TYPES and dataclasses.is_dataclass(tree):
        fields = dataclasses.fields(tree)
        children = {f.name for f in fields if f.metadata.get("pytree_node", True)}
        return {
            "node": type(tree).__name__,
            "static": {f.name: getattr(tree, f.name) for f in fields if f.name not in children},
            "children": {n: _flatten(getattr(tree, n), f"{path}/{n}", tensors) for n in sorted(children)},
        }
    array = np.asarray(jax.device_get(tree))
    stored = array if array.dtype in _NATIVE else array.view(np.dtype(f"uint{8 * array.dtype.itemsize}"))
    tensors[path] = np.ascontiguousarray(stored)
    return {"tensor": path, "dtype": array.dtype.name, "shape": list(array.shape)}


def _unflatten(node: dict[str, Any], f, used: set[str]) -> Any:
    """The tree `_flatten` described, its arrays read from the open safetensors file `f`."""
    if "dict" in node:
        return {k: _unflatten(v, f, used) for k, v in node["dict"].items()}
    if "node" in node:
        children = {k: _unflatten(v, f, used) for k, v in node["children"].items()}
        return _NODE_TYPES[node["node"]](**children, **node["static"])
    name, dtype = node["tensor"], jnp.dtype(node["dtype"])
    array = f.get_tensor(name)
    array = array if array.dtype == dtype else array.view(dtype)
    if list(array.shape) != node["shape"]:
        raise ValueError(f"tensor {name!r} has shape {list(array.shape)}, the manifest says {node['shape']}")
    used.add(name)
    return array


# ----------------------------------------------------------------------------- entries


def _read(entry: str) -> tuple[ModelConfig, dict[str, Any], Any]:
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy import, only when asked)

    config_file = os.path.join(entry, CONFIG_FILE)
    with open(config_file) as fh:
        config = parse_config(json.load(fh), config_file)
    with safe_open(os.path.join(entry, WEIGHTS_FILE), framework="numpy") as f:
        manifest = json.loads((f.metadata() or {}).get("manifest", "{}"))
        if manifest.get("format_version") != FORMAT_VERSION or "tree" not in manifest:
            raise ValueError(f"{WEIGHTS_FILE} has no manifest of format version {FORMAT_VERSION}")
        used: set[str] = set()
        params = _unflatten(manifest["tree"], f, used)
        if used != set(f.keys()):
            raise ValueError(f"{WEIGHTS_FILE} holds tensors its manifest does not name")
    tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    return config, jax.device_put(params), tokenizer


def _read_entry(root: str, entry: str):
    """The entry's (config, params, tokenizer); None when it is absent or damaged (then removed, one line)."""
    if not os.path.isdir(entry):
        return None
    try:
        return _read(entry)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        reason = " ".join(str(e).split())  # one line, whatever the library's message
        print(f"model cache: removing the damaged entry {entry} ({reason}); converting again", file=sys.stderr)
        with _locked(os.path.join(root, _LOCK_FILE)):
            shutil.rmtree(entry, ignore_errors=True)
        return None


def _store(root: str, key: str, file: str, config: ModelConfig, params: dict[str, Any], tokenizer, max_bytes: int):
    """Writes the entry `<root>/<key>` (temporary sibling, then rename under the lock) and evicts past
    `max_bytes`; a problem leaves it unstored, with one line."""
    tensors: dict[str, np.ndarray] = {}
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": os.path.realpath(file),
        "tree": _flatten(params, "", tensors),
    }
    nbytes = sum(a.nbytes for a in tensors.values())
    if nbytes > max_bytes:
        print(
            f"model cache: the converted {os.path.basename(file)} ({nbytes / 2**30:.1f} GiB) is larger than the "
            f"cache's bound ({max_bytes / 2**30:.1f} GiB); not stored"
        )
        return
    entry = os.path.join(root, key)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key[:16]}-", dir=root)
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"manifest": json.dumps(manifest)})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as fh:
            json.dump(hf_config_dict(config), fh, indent=1)
        tokenizer.save_pretrained(tmp)
        with _locked(os.path.join(root, _LOCK_FILE)):
            if os.path.isdir(entry):
                return  # stored meanwhile by another run: ours is discarded
            os.rename(tmp, entry)
            tmp = None
            print(
                f"model: stored the converted {os.path.basename(file)} in the cache {entry} ({_size(entry) / 2**30:.2f} GiB)"
            )
            _evict(root, max_bytes, keep=entry)
    except OSError as e:
        print(
            f"model cache: could not store {entry} ({e.strerror or e}); the model is converted again next run",
            file=sys.stderr,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
