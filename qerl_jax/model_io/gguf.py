"""Read llama.cpp GGUF files (architectures `llama` and `qwen2`) as a Hugging Face-shaped model.

    model = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # header only: validated, nothing dequantized
    model.config                                            # ModelConfig from the metadata
    for name, array_f32 in model.tensors(): ...             # HF names ("model.layers.0.self_attn.q_proj.weight")

`qerl_jax.load_model` / `load_tokenizer` accept a `.gguf` file (or a directory holding exactly
one, and no config.json) through this module; `python -m qerl_jax.quantize --model X.gguf`
exports it first (`export_hf_checkpoint`). Tensors are dequantized to float32 by the `gguf`
package (SUPPORTED_TENSOR_TYPES). llama.cpp's converter permutes the rows of llama's q/k
weights (its RoPE rotates interleaved pairs, HF's rotates halves); `tensors()` undoes that.
Qwen2 files are stored unpermuted (llama.cpp runs them with NeoX RoPE).

Everything that can be checked without dequantizing (magic, truncation, architecture, tensor
types, names and shapes) is checked in `open_gguf`, so a bad file fails before any weight is
read and nothing is half-loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
from typing import Any, Iterator

import numpy as np

from qerl_jax.model_io.hf_layout import SUPPORTED_ARCHITECTURES, CheckpointError, expected_shapes, hf_config_dict
from qerl_jax.models.qwen2 import ModelConfig

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# Tensor types the gguf package dequantizes (numpy) that we accept.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _gguf_lib():
    try:
        import gguf  # noqa: PLC0415 (optional dependency, only for GGUF files)
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"), or None."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def find_gguf_file(path: str) -> str | None:
    """The GGUF file `path` names: a `.gguf` file, or a directory without config.json holding one.

    None for anything else (a Hugging Face checkpoint directory, a missing path), which the
    safetensors loader then handles. A directory with several .gguf files is an error.
    """
    if os.path.isfile(path):
        return path if path.endswith(GGUF_SUFFIX) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(GGUF_SUFFIX))
    if len(files) > 1:
        raise CheckpointError(
            f"{path} holds {len(files)} GGUF files ({', '.join(files)}); pass the path of the one to load"
        )
    return os.path.join(path, files[0]) if files else None


@dataclasses.dataclass
class GGUFModel:
    """A validated GGUF file: its config, metadata and (memory-mapped) tensors."""

    path: str
    config: ModelConfig
    metadata: dict[str, Any]  # scalar / string metadata (arrays such as the vocabulary left out)
    reader: Any  # gguf.GGUFReader

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF layout) for every tensor, dequantized one at a time."""
        gguf = _gguf_lib()
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
            if self.config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = self.config.num_attention_heads if "q_proj" in name else self.config.num_key_value_heads
                array = unpermute_rows(array, heads)
            yield name, array


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: per head, rows (0, 2, 4, ..., 1, 3, ...) -> (0, 1, 2, ...).

    w: [num_heads * head_dim, ...]. llama.cpp stores row i * 2 + j of a head's rotary pairs as row
    j * head_dim / 2 + i of HF's rotate-half layout, inverted here.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _config_from_metadata(path: str, reader, arch: str, names: set[str]) -> ModelConfig:
    def get(key: str, default: Any = KeyError) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            if default is KeyError:
                raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is missing")
            return default
        if isinstance(value, list):
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is per-layer ({value[:4]}...); not supported")
        return value

    d, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", d // heads))
    rot = int(get("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(f"{path}: partial RoPE ({arch}.rope.dimension_count={rot} < head_dim={head_dim})")
    scaling_type = get("rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = (("factor", float(get("rope.scaling.factor"))), ("rope_type", "linear"))
    elif scaling_type != "none":
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type={scaling_type!r} is not supported (none, linear)")
    vocab = get("vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is in the metadata")
        vocab = len(tokens.data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=d,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(get("context_length", 32768)),
        model_type=arch,
        rope_scaling=rope_scaling,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=(int(eos),) if eos is not None else (),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def open_gguf(path: str) -> GGUFModel:
    """Opens and validates a GGUF file (or the one GGUF file of a directory); reads no weights.

    Raises CheckpointError naming the file and the problem: not a GGUF file, truncated or
    corrupt, an unsupported architecture or tensor type, a tensor of an unknown name or
    shape, or a missing tensor.
    """
    file = find_gguf_file(path) if os.path.isdir(path) else path
    if file is None:
        raise CheckpointError(f"{path} holds no .gguf file")
    if not os.path.isfile(file):
        raise CheckpointError(f"GGUF file {file!r} does not exist")
    with open(file, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise CheckpointError(f"{file} is not a GGUF file (it does not start with the bytes 'GGUF')")
    st = os.stat(file)
    return _open_checked(file, st.st_size, st.st_mtime_ns)


# One parse per file and process: the checks, the weights and the tokenizer each open the file, and
# gguf-py's metadata parse takes ~12 s for a Qwen2.5 vocabulary. Size and mtime in the key: a
# changed file is parsed again.
@functools.lru_cache(maxsize=2)
def _open_checked(file: str, size: int, mtime_ns: int) -> GGUFModel:
    del mtime_ns  # part of the cache key only
    gguf = _gguf_lib()
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise CheckpointError(f"{file}: cannot read the GGUF file (truncated or corrupt?): {e}") from None
    for t in reader.tensors:  # the reader maps lazily; a file cut at a tensor boundary passes it
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{file} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, the file has {size}"
            )
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{file}: GGUF architecture {arch!r} is not supported; expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    bad_types = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad_types:
        first = next(t.name for t in reader.tensors if t.tensor_type.name in bad_types)
        raise CheckpointError(
            f"{file}: tensor type(s) {bad_types} (e.g. tensor {first!r}) are not supported; "
            f"expected one of {list(SUPPORTED_TENSOR_TYPES)}"
        )
    names = {t.name for t in reader.tensors}
    unknown = sorted(n for n in names if hf_tensor_name(n) is None)
    if unknown:
        raise CheckpointError(
            f"{file}: tensor(s) {unknown[:5]} have no counterpart in a {arch} model"
            + (" (llama3 RoPE frequency factors are not supported)" if "rope_freqs.weight" in unknown else "")
        )
    config = _config_from_metadata(file, reader, arch, names)
    expected = expected_shapes(config)
    for t in reader.tensors:
        name, shape = hf_tensor_name(t.name), tuple(int(s) for s in reversed(t.shape.tolist()))
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {t.name!r} for a {arch} model of this config")
        if shape != expected[name]:
            raise CheckpointError(f"{file}: tensor {t.name!r} has shape {shape}, expected {expected[name]}")
    missing = sorted(set(expected) - {hf_tensor_name(n) for n in names})
    if missing:
        raise CheckpointError(f"{file}: {len(missing)} tensor(s) are missing, e.g. {missing[:3]} (HF names)")
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and len(field.types) == 1 and len(field.data) == 1:
            metadata[key] = field.contents()
    return GGUFModel(path=file, config=config, metadata=metadata, reader=reader)


def load_tokenizer(path: str):
    """The tokenizer + chat template of a GGUF file's metadata (transformers' GGUF conversion), offline.

    Built once per file and process (the config check, then the model load, each ask): transformers
    parses the metadata again, seconds for a large vocabulary. Each caller gets its own copy.
    """
    file = open_gguf(path).path
    st = os.stat(file)
    return copy.deepcopy(_built_tokenizer(file, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _built_tokenizer(file: str, size: int, mtime_ns: int):
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy import, only when asked)

    del size, mtime_ns  # part of the cache key only
    model = open_gguf(file)
    if "tokenizer.ggml.model" not in model.reader.fields:
        raise CheckpointError(f"{model.path}: the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(model.path)), gguf_file=os.path.basename(model.path), local_files_only=True
        )
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise CheckpointError(f"{model.path}: transformers cannot build a tokenizer from its metadata: {e}") from e
    return fill_special_tokens(tokenizer, model.metadata)


# The special tokens a GGUF file names by id (llama.cpp's metadata keys), by tokenizer attribute.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def fill_special_tokens(tokenizer, metadata: dict[str, Any]):
    """Sets the special tokens the metadata names and the tokenizer lacks (transformers' GGUF
    conversion sets the pad token in some versions only: 5.23 does, 5.17 does not)."""
    for attr, key in SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if getattr(tokenizer, attr) is None and isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def export_hf_checkpoint(path: str, out_dir: str) -> str:
    """Writes a GGUF file as a Hugging Face checkpoint directory: config.json, model.safetensors
    (the dequantized tensors, float32, so nothing is rounded again), and the tokenizer files
    when the metadata has a tokenizer."""
    import safetensors.numpy  # noqa: PLC0415

    model = open_gguf(path)
    os.makedirs(out_dir, exist_ok=True)
    tensors = dict(model.tensors())
    safetensors.numpy.save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(model.config), f, indent=2)
    if "tokenizer.ggml.model" in model.reader.fields:
        load_tokenizer(model.path).save_pretrained(out_dir)
    return out_dir
