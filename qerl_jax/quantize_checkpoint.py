"""Quantize a Hugging Face checkpoint into a compressed-tensors (vLLM-loadable) checkpoint.

The routine behind the `python -m qerl_jax.quantize` command (`qerl_jax.quantize`).
The model directory may also be a llama.cpp GGUF file: it is first exported as a float32 HF checkpoint
(qerl_jax.model_io.gguf.export_hf_checkpoint, in a temporary directory next to the output).

Every 2-D `model.layers.*.(self_attn|mlp).*_proj.weight` becomes `weight_packed`,
`weight_scale` (+ `weight_global_scale` for nvfp4); all other tensors are copied unchanged.
Shards mirror the input's (single `model.safetensors` or sharded with an index). For nvfp4
q/k/v and gate/up of each layer share one global scale (their joint amax), which vLLM
requires; that takes a first pass over the linear weights to measure amax. Tensors are read
one at a time and each output shard is written once complete, so memory holds at most one
input tensor plus one output shard.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import shutil
from typing import Sequence

import numpy as np

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
QUANTIZABLE = re.compile(r"^(?P<module>model\.layers\.\d+\.(?:self_attn|mlp)\.(?P<proj>\w+_proj))\.weight$")
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
# Tokenizer / generation files copied next to the new weights and config.
COPY_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "*.tiktoken",
    "*.model",
    "preprocessor_config.json",
    "README*",
    "LICENSE*",
)


class QuantizeError(ValueError):
    """Bad input to the quantization CLI; the message names the file, tensor or option."""


def _shards(model_dir: str) -> tuple[list[str], dict | None]:
    """The input shard file names and the index dict (None for a single file)."""
    if os.path.isfile(os.path.join(model_dir, SAFETENSORS_FILE)):
        return [SAFETENSORS_FILE], None
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise QuantizeError(f"{index_path} has an empty weight_map")
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise QuantizeError(f"{index_path} lists shard(s) that do not exist: {missing}")
        return shards, index
    names = os.listdir(model_dir)
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        raise QuantizeError(
            f"{model_dir} holds only PyTorch pickle weights (*.bin); this tool reads safetensors only. Convert "
            "once with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, "
            "safe_serialization=True)"
        )
    raise QuantizeError(f"{model_dir} has no {SAFETENSORS_FILE} and no {SAFETENSORS_INDEX}")


def _fused_key(name: str) -> str:
    m = QUANTIZABLE.match(name)
    group = _FUSED.get(m.group("proj")) if m else None
    return m.group("module").rsplit(".", 1)[0] + "." + group if group else name


def _is_quantizable(name: str, shape: Sequence[int]) -> bool:
    return QUANTIZABLE.match(name) is not None and len(shape) == 2


def _check_tensor(name: str, array: np.ndarray, fmt: str, block: int) -> None:
    if array.shape[-1] % block:
        raise QuantizeError(
            f"tensor {name!r} has shape {tuple(array.shape)}: {fmt} needs K (the last axis) to be a multiple of {block}"
        )
    if not np.all(np.isfinite(array.astype(np.float32))):
        raise QuantizeError(f"tensor {name!r} has non-finite values (inf or nan); cannot quantize it")


def format_problems_of(fmt: str) -> list[str]:
    """What is wrong with --format (empty: nothing)."""
    from qerl_jax.quant.formats import CONFIG_FORMATS, CT_FORMATS  # noqa: PLC0415 (keeps `--help` fast)

    if fmt in CT_FORMATS:
        return []
    if fmt in CONFIG_FORMATS:
        return [f"--format {fmt!r} cannot be written as a compressed-tensors checkpoint; expected one of {CT_FORMATS}"]
    return [f"unknown --format {fmt!r}; expected one of {CT_FORMATS}"]


def argument_problems(model_dir: str, out_dir: str, fmt: str, *, overwrite: bool) -> list[str]:
    """Every problem of the arguments, found before any work: the format, the input directory
    (config.json, and every safetensors header, the shard index and the tensor shapes against
    config.json, read without tensor data) and the output directory."""
    from qerl_jax import validate  # noqa: PLC0415 (keeps `--help` fast)
    from qerl_jax.model_io import loader  # noqa: PLC0415

    problems = format_problems_of(fmt)
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        problems.append(f"model directory {model_dir!r} does not exist")
    elif not os.path.isfile(config_path):
        problems.append(f"{config_path} is missing: a Hugging Face checkpoint directory needs config.json")
    else:
        try:
            raw = loader.read_json(config_path)
            _shards(model_dir)
        except (loader.CheckpointError, QuantizeError) as e:
            problems.append(str(e))
        else:
            if "quantization_config" in raw:
                method = raw["quantization_config"].get("quant_method")
                problems.append(
                    f"{config_path} already has a quantization_config (quant_method={method!r}); expected a dense checkpoint"
                )
            else:
                try:  # shapes are checked when config.json describes a supported model
                    config, _ = loader.read_config(model_dir)
                except loader.CheckpointError:
                    config = None
                problems += validate.checkpoint_file_problems(model_dir, config, raw, need_tokenizer=False)
    if os.path.abspath(out_dir) == os.path.abspath(model_dir):
        problems.append("--out must differ from --model")
    else:
        problems += out_dir_problems(out_dir, overwrite=overwrite)
    return problems


def out_dir_problems(out_dir: str, *, overwrite: bool) -> list[str]:
    """What stops writing the output to `out_dir`: a file in its place or above it, no write
    permission, or files in it without --overwrite."""
    from qerl_jax.workdir import output_dir_problems  # noqa: PLC0415 (keeps `--help` fast)

    problems = [f"--out {out_dir!r}: {p}" for p in output_dir_problems(out_dir)]
    if not problems and os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        problems.append(f"output directory {out_dir!r} is not empty (pass --overwrite to replace its files)")
    return problems


def quantize_checkpoint(
    model_dir: str,
    out_dir: str,
    fmt: str,
    *,
    fuse_global_scale: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> str:
    """Writes the `fmt`-quantized compressed-tensors checkpoint of `model_dir` to `out_dir`.

    Returns out_dir. Raises QuantizeError (a ValueError) listing every problem of
    `argument_problems` (a missing directory or config.json, pickle-only, already quantized,
    truncated or mismatched checkpoints, formats without a compressed-tensors representation,
    a non-empty output) before anything is written, and later for K not a multiple of the
    block size and non-finite weights (naming the tensor).
    """
    from qerl_jax import quant  # noqa: PLC0415 (keeps `--help` fast)
    from qerl_jax.validate import format_problems  # noqa: PLC0415

    if _gguf_file(model_dir) is not None:  # exported to a float32 HF checkpoint, then quantized
        problems = format_problems_of(fmt)
        if problems:
            raise QuantizeError(format_problems(problems))
        return _quantize_gguf(model_dir, out_dir, fmt, fuse_global_scale, overwrite, progress)
    problems = argument_problems(model_dir, out_dir, fmt, overwrite=overwrite)
    if problems:
        raise QuantizeError(format_problems(problems))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    shards, index = _shards(model_dir)
    block = quant.REGISTRY[fmt].block_size
    read = functools.partial(_read_tensors, model_dir, shards, progress=progress)
    # Pass 1 (nvfp4): amax of every linear weight, maxed over fused groups.
    group_amax = _group_amax(read, fmt, block, fuse_global_scale) if fmt == "nvfp4" else {}
    os.makedirs(out_dir, exist_ok=True)
    written, ignore = _write_quantized_shards(read, shards[0], out_dir, fmt, block, group_amax, fuse_global_scale)
    _write_index_and_config(model_dir, out_dir, fmt, config, index, written, ignore)
    return out_dir


def _read_tensors(model_dir: str, shards: list[str], desc: str, only_quantizable: bool, *, progress: bool):
    """Yields (shard, name, array) over all shards, with a progress bar over tensors."""
    from safetensors import safe_open  # noqa: PLC0415 (keeps `--help` fast)
    from tqdm import tqdm  # noqa: PLC0415

    total = 0
    for shard in shards:
        with safe_open(os.path.join(model_dir, shard), framework="numpy") as f:
            total += sum(1 for n in f.keys() if not only_quantizable or QUANTIZABLE.match(n))
    with tqdm(total=total, desc=desc, unit="tensor", disable=not progress) as bar:
        for shard in shards:
            with safe_open(os.path.join(model_dir, shard), framework="numpy") as f:
                for name in f.keys():
                    if only_quantizable and not QUANTIZABLE.match(name):
                        continue
                    yield shard, name, f.get_tensor(name)
                    bar.update(1)


def _group_amax(read, fmt: str, block: int, fuse_global_scale: bool) -> dict[str, np.float32]:
    """The amax of every linear weight (checked first), maxed over its fused group when fusing."""
    group_amax: dict[str, np.float32] = {}
    for _, name, array in read("measuring amax", only_quantizable=True):
        if not _is_quantizable(name, array.shape):
            continue
        _check_tensor(name, array, fmt, block)
        key = _fused_key(name) if fuse_global_scale else name
        amax = np.float32(np.max(np.abs(array.astype(np.float32))))
        group_amax[key] = max(group_amax.get(key, np.float32(0)), amax)
    return group_amax


class _ShardWriter:
    """Output tensors collected per shard, each shard written once complete."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.tensors: dict[str, np.ndarray] = {}
        self.weight_map: dict[str, str] = {}  # tensor name -> its shard
        self.total_size = 0  # bytes written

    def add(self, name: str, array: np.ndarray, shard: str) -> None:
        self.tensors[name] = array
        self.weight_map[name] = shard

    def flush(self, shard: str) -> None:
        import safetensors.numpy  # noqa: PLC0415 (keeps `--help` fast)

        path = os.path.join(self.out_dir, shard)
        safetensors.numpy.save_file(self.tensors, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)  # safetensors creates it owner-only
        self.total_size += sum(a.nbytes for a in self.tensors.values())
        self.tensors = {}


def _write_quantized_shards(
    read,
    first_shard: str,
    out_dir: str,
    fmt: str,
    block: int,
    group_amax: dict[str, np.float32],
    fuse_global_scale: bool,
) -> tuple[_ShardWriter, set[str]]:
    """Pass 2: every shard written with its linear weights quantized (packed + scales) and the other
    tensors copied. (The writer: weight map and bytes written, the modules the "Linear" target skips.)"""
    import jax  # noqa: PLC0415 (keeps `--help` fast)
    import jax.numpy as jnp  # noqa: PLC0415

    from qerl_jax import quant  # noqa: PLC0415
    from qerl_jax.quant import compressed_tensors as ct  # noqa: PLC0415

    quantize_fn = jax.jit(quant.quantize, static_argnums=1)
    writer = _ShardWriter(out_dir)
    ignore = {"lm_head"}
    current = first_shard
    for shard, name, array in read(f"quantizing to {fmt}", only_quantizable=False):
        if shard != current:
            writer.flush(current)
            current = shard
        if _is_quantizable(name, array.shape):
            if fmt != "nvfp4":  # nvfp4 weights were checked in pass 1
                _check_tensor(name, array, fmt, block)
            amax = None
            if fmt == "nvfp4":
                amax = jnp.float32(group_amax[_fused_key(name) if fuse_global_scale else name])
            packed = quantize_fn(jnp.asarray(array), fmt, amax=amax)
            module = name[: -len(".weight")]
            for suffix, value in ct.tensors_from_packed(packed).items():
                writer.add(f"{module}.{suffix}", value, shard)
            continue
        if name.endswith(".weight") and array.ndim == 2 and name != "model.embed_tokens.weight":
            ignore.add(name[: -len(".weight")])  # a dense 2-D weight the "Linear" target must skip
        writer.add(name, array, shard)
    writer.flush(current)
    return writer, ignore


def _write_index_and_config(
    model_dir: str, out_dir: str, fmt: str, config: dict, index: dict | None, written: _ShardWriter, ignore: set[str]
) -> None:
    """The shard index (if the input had one), config.json with its quantization_config, and the
    tokenizer / generation files copied."""
    from qerl_jax.quant import compressed_tensors as ct  # noqa: PLC0415 (keeps `--help` fast)

    if index is not None:
        new_index = {
            "metadata": {**index.get("metadata", {}), "total_size": written.total_size},
            "weight_map": dict(sorted(written.weight_map.items())),
        }
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
            json.dump(new_index, f, indent=2)
    config["quantization_config"] = ct.quantization_config(fmt, ignore=sorted(ignore))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for entry in sorted(os.listdir(model_dir)):
        src = os.path.join(model_dir, entry)
        if os.path.isfile(src) and any(fnmatch.fnmatch(entry, p) for p in COPY_PATTERNS):
            shutil.copyfile(src, os.path.join(out_dir, entry))


def _gguf_file(model_dir: str) -> str | None:
    from qerl_jax.model_io import gguf  # noqa: PLC0415
    from qerl_jax.model_io.loader import CheckpointError  # noqa: PLC0415

    try:
        return gguf.find_gguf_file(model_dir)
    except CheckpointError as e:
        raise QuantizeError(str(e)) from None


def _quantize_gguf(path: str, out_dir: str, fmt: str, fuse_global_scale: bool, overwrite: bool, progress: bool) -> str:
    """A GGUF file: exported (float32, next to out_dir, removed after) as a HF checkpoint, then quantized."""
    import tempfile  # noqa: PLC0415

    from qerl_jax.model_io import gguf  # noqa: PLC0415
    from qerl_jax.model_io.loader import CheckpointError  # noqa: PLC0415

    problems = out_dir_problems(out_dir, overwrite=overwrite)
    if problems:
        raise QuantizeError(problems[0])
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        try:
            gguf.export_hf_checkpoint(path, tmp)
        except CheckpointError as e:
            raise QuantizeError(str(e)) from None
        return quantize_checkpoint(
            tmp, out_dir, fmt, fuse_global_scale=fuse_global_scale, overwrite=overwrite, progress=progress
        )
