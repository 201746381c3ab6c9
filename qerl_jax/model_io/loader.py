"""Load a local Hugging Face checkpoint directory (config.json + safetensors) into our pytrees.

Tensors are read one at a time into stacked host buffers ([L, ...] per projection), so host
memory holds one copy of the model, in its final (bf16 or packed 4-bit) form; with `quant`
each linear is quantized on the device as it is read and only its packed form is kept.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from qerl_jax.model_io import gguf
from qerl_jax.model_io.hf_layout import (  # noqa: F401 (part of this module's API)
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    expected_shapes,
    hf_linear_name,
    parse_config,
)
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.projections import FUSED_GROUPS, PROJECTIONS
from qerl_jax.quant.formats import DENSE, FORMATS

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def read_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Parses `path/config.json` into a ModelConfig; also returns the raw dict."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"model directory {path!r} does not exist. Point the config at a local Hugging Face checkpoint "
            "directory (config.json + *.safetensors + tokenizer files); the hub is not used."
        )
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is missing: a Hugging Face checkpoint directory needs config.json")
    raw = read_json(cfg_path)
    return parse_config(raw, cfg_path), raw


def read_json(path: str) -> Any:
    """A JSON file of a checkpoint; CheckpointError naming the file if it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is damaged: download it again") from None


def unreadable_safetensors(file: str, error: Exception) -> str:
    """The one-line message for a safetensors file that cannot be read."""
    return f"{file} is not a readable safetensors file ({error}); it is truncated or damaged: download it again"


def weight_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint (single file or sharded with an index)."""
    single = os.path.join(path, SAFETENSORS_FILE)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map (tensor name -> shard file)")
        shards = sorted(set(weight_map.values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    names = os.listdir(path)
    if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in names):
        raise CheckpointError(
            f"{path} holds only PyTorch pickle weights (*.bin); qerl-jax loads safetensors only, since pickles can "
            "execute code. Convert once with transformers: AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out_dir, safe_serialization=True)."
        )
    raise CheckpointError(f"{path} has no {SAFETENSORS_FILE} and no {SAFETENSORS_INDEX}")


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, numpy array) for every tensor of the checkpoint, one at a time."""
    from qerl_jax.quant.compressed_tensors import read_safetensors  # noqa: PLC0415

    for file in weight_files(path):
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    if f.get_slice(name).get_dtype().startswith("F8"):
                        # safetensors' numpy backend has no float8 (NVFP4 block scales): read raw bytes.
                        yield from read_safetensors(file, [name])
                    else:
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(unreadable_safetensors(file, e)) from None


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)$")
_NORM_RE = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")


class _StackedBuffers:
    """Host buffers that collect per-layer arrays into [L, ...] stacks as they arrive."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.buffers: dict[tuple[str, ...], Any] = {}
        self.filled: dict[tuple[str, ...], np.ndarray] = {}

    def put(self, key: tuple[str, ...], layer: int, value) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if key not in self.buffers:
            stacked = [np.empty((self.num_layers, *np.shape(x)), dtype=np.asarray(x).dtype) for x in leaves]
            self.buffers[key] = (stacked, treedef)
            self.filled[key] = np.zeros(self.num_layers, bool)
        stacked, _ = self.buffers[key]
        for buf, leaf in zip(stacked, leaves):
            buf[layer] = np.asarray(leaf)
        self.filled[key][layer] = True

    def get(self, key: tuple[str, ...]):
        stacked, treedef = self.buffers[key]
        return jax.tree_util.tree_unflatten(treedef, stacked)


def _open_checkpoint(path: str) -> tuple[ModelConfig, dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    """(config, raw config.json dict, tensor iterator) of a HF directory or a GGUF file (validated first)."""
    if gguf.find_gguf_file(path) is not None:
        model = gguf.open_gguf(path)
        return model.config, {}, model.tensors()
    config, raw = read_config(path)
    return config, raw, iter_tensors(path)


def load_model(
    path: str,
    dtype: str = "bfloat16",
    quant: str | None = None,
    *,
    quant_skip: tuple[str, ...] = (),
) -> tuple[ModelConfig, dict[str, Any]]:
    """Loads a local HF Qwen2/Qwen2.5/Llama checkpoint.

    Args:
      path: directory with config.json and model.safetensors (or sharded + index), or a llama.cpp
        GGUF file (or a directory holding one and no config.json): see `qerl_jax.model_io.gguf`.
      dtype: "bfloat16" | "float32" | "float16" for the dense tensors.
      quant: None/"bf16" to keep linears dense, or "nvfp4" | "mxfp4" | "nf4" to quantize every
        linear projection while loading. A compressed-tensors NVFP4 checkpoint is read as packed
        weights directly (then `quant` must be None or match it).
      quant_skip: projection names (e.g. ("down_proj",)) kept dense even when quantizing.
    Returns:
      (config, params) with params = {"base": ..., "norms": ...} on the default device; the
      RMSNorm scales are float32 (tiny, and where AQN adds its noise).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(_DTYPES)}")
    np_dtype = _DTYPES[dtype]
    config, raw, tensors = _open_checkpoint(path)
    stored_fmt = None
    if quant is None:  # the public default: as stored
        quant = DENSE
    if quant != DENSE or "quantization_config" in raw:
        from qerl_jax import quant as quantlib  # noqa: PLC0415 (only needed for quantized models)

        stored_fmt = quantlib.compressed_tensors.detect_format(raw)
    if quant == DENSE:
        quant = stored_fmt
    elif quant not in FORMATS:
        raise ValueError(f"quant {quant!r} is not supported; expected None, 'bf16' or one of {FORMATS}")
    elif stored_fmt is not None and stored_fmt != quant:
        raise CheckpointError(f"{path} is stored as {stored_fmt}; it cannot be loaded as {quant}")

    expected = expected_shapes(config)
    layers = _StackedBuffers(config.num_hidden_layers)
    top: dict[str, np.ndarray] = {}
    packed_parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    pending: dict[tuple[int, tuple[str, ...]], dict[str, np.ndarray]] = {}  # fused groups awaiting members
    seen: set[str] = set()
    stored_fields = set(quantlib.compressed_tensors.TENSOR_SUFFIXES[stored_fmt]) if stored_fmt else set()

    def quantize_group(layer: int, arrays: dict[str, np.ndarray]) -> None:
        """Quantizes the projections of one fused group (nvfp4: one shared global scale, as vLLM)."""
        dense = {proj: jnp.asarray(a) for proj, a in arrays.items()}
        amax = None
        if quant == "nvfp4":
            amax = jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32))) for w in dense.values()]))
        for proj, w in dense.items():
            name = f"{hf_linear_name(layer, proj)}.weight"
            if not bool(jnp.all(jnp.isfinite(w))):
                raise CheckpointError(f"{path}: tensor {name!r} has non-finite values")
            packed = quantlib.quantize(w, quant, amax=amax) if amax is not None else quantlib.quantize(w, quant)
            layers.put(("base", proj, "w"), layer, jax.device_get(packed))

    for name, array in tensors:
        if name.startswith("model.rotary_emb") or name.endswith(".inv_freq"):
            continue
        m = _LAYER_RE.match(name)
        ct_part = None
        if m is None and stored_fmt:
            ct = re.match(r"(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj))\.(weight_\w+)$", name)
            if ct:
                ct_part = (int(ct.group(2)), ct.group(3), ct.group(4))
        if ct_part is not None:
            layer, proj, field = ct_part
            if field not in stored_fields:
                continue  # e.g. input_global_scale of W4A4 checkpoints: we keep activations in bf16
            parts = packed_parts.setdefault((layer, proj), {})
            parts[field] = array
            if stored_fields <= parts.keys():
                packed = quantlib.compressed_tensors.packed_from_tensors(parts, stored_fmt)
                layers.put(("base", proj, "w"), layer, packed)
                seen.add(f"{hf_linear_name(layer, proj)}.weight")
                del packed_parts[(layer, proj)]
            continue
        if name not in expected:
            if name.endswith("_proj.weight_zero_point") or name.endswith(".weight_shape"):
                continue
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {config.model_type} model of this config")
        if tuple(array.shape) != expected[name]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, expected {expected[name]}")
        seen.add(name)
        if m is not None:
            layer, proj, kind = int(m.group(1)), m.group(3), m.group(4)
            if kind == "weight" and quant and proj not in quant_skip:
                group = next((g for g in FUSED_GROUPS if proj in g), (proj,))
                group = tuple(p for p in group if p not in quant_skip)
                members = pending.setdefault((layer, group), {})
                members[proj] = array
                if len(members) == len(group):
                    quantize_group(layer, pending.pop((layer, group)))
            else:
                layers.put(("base", proj, "w" if kind == "weight" else "b"), layer, array.astype(np_dtype))
            continue
        n = _NORM_RE.match(name)
        if n is not None:  # norms stay float32 whatever `dtype`: AQN's small noise must not round away
            layers.put(("norms", n.group(2)), int(n.group(1)), array.astype(np.float32))
            continue
        top[name] = array.astype(np.float32 if name == "model.norm.weight" else np_dtype)

    if pending or packed_parts:
        incomplete = sorted(
            {hf_linear_name(layer, p) for (layer, g) in pending for p in g}
            | {hf_linear_name(l, p) for l, p in packed_parts}
        )
        raise CheckpointError(f"{path}: incomplete quantized projection(s): {incomplete[:5]}")
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: checkpoint is missing {len(missing)} tensor(s): {shown}")

    base_layers = {proj: {} for proj in PROJECTIONS}
    norm_layers = {}
    for key in layers.buffers:
        if key[0] == "base":
            base_layers[key[1]][key[2]] = layers.get(key)
        else:
            norm_layers[key[1]] = layers.get(key)
    base = {"embed": top["model.embed_tokens.weight"], "layers": base_layers}
    if not config.tie_word_embeddings:
        base["lm_head"] = top["lm_head.weight"]
    params = {"base": base, "norms": {"final_norm": top["model.norm.weight"], "layers": norm_layers}}
    return config, jax.device_put(params)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer (transformers AutoTokenizer, with its chat template), offline; a GGUF
    file's from its metadata."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy import, only when asked)

    if gguf.find_gguf_file(path) is not None:
        return gguf.load_tokenizer(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"tokenizer directory {path!r} does not exist")
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    ):
        raise CheckpointError(f"{path}: no tokenizer files (expected tokenizer.json or tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no usable tokenizer files (tokenizer.json / tokenizer_config.json): {e}") from e
