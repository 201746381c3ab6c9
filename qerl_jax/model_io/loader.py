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
    config, raw, tensors = _open_checkpoint(path)
    quant, stored_fmt = _load_format(path, quant, raw)
    collector = _TensorCollector(path, config, _DTYPES[dtype], quant, quant_skip, stored_fmt)
    for name, array in tensors:
        collector.add(name, array)
    collector.check_complete()
    return config, jax.device_put(collector.params())


def _load_format(path: str, quant: str | None, raw: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the format the linears are loaded in, the compressed-tensors format they are stored in); None: dense.
    `quant` None or "bf16" loads them as stored."""
    stored_fmt = None
    if quant is None:  # the public default: as stored
        quant = DENSE
    if quant != DENSE or "quantization_config" in raw:
        from qerl_jax import quant as quantlib  # noqa: PLC0415 (only needed for quantized models)

        stored_fmt = quantlib.compressed_tensors.detect_format(raw)
    if quant == DENSE:
        return stored_fmt, stored_fmt
    if quant not in FORMATS:
        raise ValueError(f"quant {quant!r} is not supported; expected None, 'bf16' or one of {FORMATS}")
    if stored_fmt is not None and stored_fmt != quant:
        raise CheckpointError(f"{path} is stored as {stored_fmt}; it cannot be loaded as {quant}")
    return quant, stored_fmt


_PACKED_RE = re.compile(r"(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj))\.(weight_\w+)$")


class _TensorCollector:
    """The checkpoint's tensors, checked (names, shapes) and stacked per layer as they arrive: dense
    linears cast to the dtype or quantized by fused group, packed (compressed-tensors) ones gathered
    field by field, norms in float32."""

    def __init__(self, path: str, config: ModelConfig, np_dtype, quant: str | None, quant_skip, stored_fmt):
        self.path, self.config, self.np_dtype = path, config, np_dtype
        self.quant, self.quant_skip, self.stored_fmt = quant, quant_skip, stored_fmt
        self.expected = expected_shapes(config)
        self.layers = _StackedBuffers(config.num_hidden_layers)
        self.top: dict[str, np.ndarray] = {}
        self.packed_parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        self.pending: dict[tuple[int, tuple[str, ...]], dict[str, np.ndarray]] = {}  # fused groups awaiting members
        self.seen: set[str] = set()
        self.stored_fields: set[str] = set()
        if stored_fmt:
            from qerl_jax import quant as quantlib  # noqa: PLC0415 (only needed for quantized models)

            self.stored_fields = set(quantlib.compressed_tensors.TENSOR_SUFFIXES[stored_fmt])

    def add(self, name: str, array: np.ndarray) -> None:
        """Takes in one tensor of the checkpoint; CheckpointError if the model has no such tensor."""
        if name.startswith("model.rotary_emb") or name.endswith(".inv_freq"):
            return
        m = _LAYER_RE.match(name)
        ct = _PACKED_RE.match(name) if m is None and self.stored_fmt else None
        if ct is not None:
            self._add_packed_part(int(ct.group(2)), ct.group(3), ct.group(4), array)
            return
        if name not in self.expected:
            if name.endswith("_proj.weight_zero_point") or name.endswith(".weight_shape"):
                return
            raise CheckpointError(
                f"{self.path}: unexpected tensor {name!r} for a {self.config.model_type} model of this config"
            )
        if tuple(array.shape) != self.expected[name]:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {tuple(array.shape)}, expected {self.expected[name]}"
            )
        self.seen.add(name)
        if m is not None:
            self._add_linear(int(m.group(1)), m.group(3), m.group(4), array)
            return
        n = _NORM_RE.match(name)
        if n is not None:  # norms stay float32 whatever `dtype`: AQN's small noise must not round away
            self.layers.put(("norms", n.group(2)), int(n.group(1)), array.astype(np.float32))
            return
        self.top[name] = array.astype(np.float32 if name == "model.norm.weight" else self.np_dtype)

    def _add_packed_part(self, layer: int, proj: str, field: str, array: np.ndarray) -> None:
        """One field of a stored packed projection; the projection is stacked once all its fields came."""
        from qerl_jax import quant as quantlib  # noqa: PLC0415 (only needed for quantized models)

        if field not in self.stored_fields:
            return  # e.g. input_global_scale of W4A4 checkpoints: we keep activations in bf16
        parts = self.packed_parts.setdefault((layer, proj), {})
        parts[field] = array
        if self.stored_fields <= parts.keys():
            packed = quantlib.compressed_tensors.packed_from_tensors(parts, self.stored_fmt)
            self.layers.put(("base", proj, "w"), layer, packed)
            self.seen.add(f"{hf_linear_name(layer, proj)}.weight")
            del self.packed_parts[(layer, proj)]

    def _add_linear(self, layer: int, proj: str, kind: str, array: np.ndarray) -> None:
        """A dense projection's weight (quantized once its fused group is complete) or bias."""
        if kind == "weight" and self.quant and proj not in self.quant_skip:
            group = next((g for g in FUSED_GROUPS if proj in g), (proj,))
            group = tuple(p for p in group if p not in self.quant_skip)
            members = self.pending.setdefault((layer, group), {})
            members[proj] = array
            if len(members) == len(group):
                self._quantize_group(layer, self.pending.pop((layer, group)))
        else:
            self.layers.put(("base", proj, "w" if kind == "weight" else "b"), layer, array.astype(self.np_dtype))

    def _quantize_group(self, layer: int, arrays: dict[str, np.ndarray]) -> None:
        """Quantizes the projections of one fused group (nvfp4: one shared global scale, as vLLM)."""
        from qerl_jax import quant as quantlib  # noqa: PLC0415 (only needed for quantized models)

        dense = {proj: jnp.asarray(a) for proj, a in arrays.items()}
        amax = None
        if self.quant == "nvfp4":
            amax = jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32))) for w in dense.values()]))
        for proj, w in dense.items():
            name = f"{hf_linear_name(layer, proj)}.weight"
            if not bool(jnp.all(jnp.isfinite(w))):
                raise CheckpointError(f"{self.path}: tensor {name!r} has non-finite values")
            packed = (
                quantlib.quantize(w, self.quant, amax=amax) if amax is not None else quantlib.quantize(w, self.quant)
            )
            self.layers.put(("base", proj, "w"), layer, jax.device_get(packed))

    def check_complete(self) -> None:
        """CheckpointError naming the projections left incomplete or the tensors missing, if any."""
        if self.pending or self.packed_parts:
            incomplete = sorted(
                {hf_linear_name(layer, p) for (layer, g) in self.pending for p in g}
                | {hf_linear_name(l, p) for l, p in self.packed_parts}
            )
            raise CheckpointError(f"{self.path}: incomplete quantized projection(s): {incomplete[:5]}")
        missing = sorted(set(self.expected) - self.seen)
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise CheckpointError(f"{self.path}: checkpoint is missing {len(missing)} tensor(s): {shown}")

    def params(self) -> dict[str, Any]:
        """{"base", "norms"} of the collected tensors, on the host."""
        base_layers = {proj: {} for proj in PROJECTIONS}
        norm_layers = {}
        for key in self.layers.buffers:
            if key[0] == "base":
                base_layers[key[1]][key[2]] = self.layers.get(key)
            else:
                norm_layers[key[1]] = self.layers.get(key)
        base = {"embed": self.top["model.embed_tokens.weight"], "layers": base_layers}
        if not self.config.tie_word_embeddings:
            base["lm_head"] = self.top["lm_head.weight"]
        return {"base": base, "norms": {"final_norm": self.top["model.norm.weight"], "layers": norm_layers}}


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
