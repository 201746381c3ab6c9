"""Checkpoint interop with compressed-tensors (the format llm-compressor writes, vLLM reads).

Per-tensor functions; callers own the Hugging Face tensor names. A quantized linear
`<module>.weight` [N, K] is stored as

* nvfp4 ("nvfp4-pack-quantized"): `<module>.weight_packed` uint8 [N, K/2],
  `<module>.weight_scale` float8_e4m3fn [N, K/16], `<module>.weight_global_scale` float32 [1];
* mxfp4 ("mxfp4-pack-quantized"): `<module>.weight_packed` uint8 [N, K/2],
  `<module>.weight_scale` uint8 [N, K/32] (E8M0 exponents).

NF4 has no compressed-tensors representation (its codebook quantization is not a
compressed-tensors scheme), so `quantization_config("nf4")` and `tensors_from_packed` of an
NF4 weight raise.

`read_safetensors` reads any safetensors file into numpy, float8 included (the numpy
backend of `safetensors` 0.8 cannot return float8 tensors).
"""

from __future__ import annotations

import json
import struct
import warnings
from typing import Any, Iterable, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np

from qerl_jax.quant.formats import CT_FORMATS, FORMATS, MXFP4, NVFP4, REGISTRY
from qerl_jax.quant.packed import PackedWeight

# `quantization_config`'s "version": the compressed-tensors release whose layout we write and test
# against, not the installed library's. It is provenance only: compressed-tensors writes its own
# `__version__` there and reads nothing back from it, and vLLM's CompressedTensorsConfig reads the
# groups, format, ignore, sparsity, KV-cache and transform fields but never "version". So a new
# release of the library changes the version it would write, not the format: tests compare every
# other field bit for bit and only this constant here (`tests/test_compressed_tensors.py`).
CT_VERSION = "0.20.0"
TENSOR_SUFFIXES = {
    "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
    "mxfp4": ("weight_packed", "weight_scale"),
}
_WEIGHT_ARGS = {
    "nvfp4": {
        "dynamic": False,
        "group_size": NVFP4.block_size,
        "num_bits": 4,
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
    },
    "mxfp4": {
        "dynamic": False,
        "group_size": MXFP4.block_size,
        "num_bits": 4,
        "scale_dtype": "torch.uint8",
        "strategy": "group",
        "symmetric": True,
        "type": "float",
    },
}
_NO_CT_FORMAT = (
    "{fmt!r} has no compressed-tensors representation (compressed-tensors supports the 4-bit "
    "float formats nvfp4 and mxfp4); checkpoints can be written as nvfp4 or mxfp4 only"
)


def _check_ct_format(fmt: str) -> None:
    if fmt in CT_FORMATS:
        return
    if fmt in FORMATS:
        raise ValueError(_NO_CT_FORMAT.format(fmt=fmt))
    raise ValueError(f"unknown format {fmt!r}; expected one of {tuple(CT_FORMATS)}")


def quantization_config(fmt: str, ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """The config.json `quantization_config` block compressed-tensors writes for `fmt`.

    Weight-only schemes (NVFP4A16 / MXFP4A16 presets) targeting every Linear module except
    those in `ignore` (module names, or "re:<regex>" patterns).
    """
    _check_ct_format(fmt)
    ct_format = REGISTRY[fmt].ct_name
    return {
        "config_groups": {
            "group_0": {
                "format": ct_format,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": dict(_WEIGHT_ARGS[fmt]),
            }
        },
        "format": ct_format,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _weights_format(weights: Mapping[str, Any], field: str) -> str:
    """compressed-tensors weight QuantizationArgs (dict) -> "nvfp4" | "mxfp4", or raise."""
    kind, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    if str(kind).lower() != "float" or bits != 4:
        raise ValueError(
            f"{field}: type={kind!r}, num_bits={bits!r} is not supported; only the 4-bit float "
            "schemes NVFP4 (group_size 16, strategy tensor_group) and MXFP4 (group_size 32, "
            "strategy group) can be loaded"
        )
    if weights.get("symmetric", True) is not True:
        raise ValueError(
            f"{field}.symmetric={weights.get('symmetric')!r}: only symmetric 4-bit float weights are supported"
        )
    if weights.get("actorder") in ("group", True):
        raise ValueError(
            f"{field}.actorder={weights.get('actorder')!r}: group activation ordering (g_idx) is not supported"
        )
    group, strategy = weights.get("group_size"), weights.get("strategy")
    if group == 16 and strategy == "tensor_group":
        return "nvfp4"
    if group == 32 and strategy == "group":
        return "mxfp4"
    raise ValueError(
        f"{field}: 4-bit float weights with group_size={group!r}, strategy={strategy!r} are not "
        "supported; expected group_size 16 with strategy 'tensor_group' (NVFP4) or group_size 32 "
        "with strategy 'group' (MXFP4)"
    )


def detect_format(hf_config: Mapping[str, Any]) -> str | None:
    """The weight format of a checkpoint from its config.json dict.

    None when there is no `quantization_config`; "nvfp4" or "mxfp4" for compressed-tensors
    NVFP4/MXFP4 weights. Raises ValueError naming the field and value for anything else
    (other quant_methods such as gptq/awq/bitsandbytes/fp8, int schemes, mixed formats,
    transforms, sparsity). Quantized activations / kv-cache of an otherwise supported
    scheme only warn: the weights load and activations run unquantized.
    """
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r} is not supported; expected "
            f"'compressed-tensors' with format {' or '.join(repr(REGISTRY[f].ct_name) for f in CT_FORMATS)}"
        )
    if qc.get("transform_config"):
        raise ValueError("config.json quantization_config.transform_config is set (rotated weights); not supported")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(
            f"config.json quantization_config.sparsity_config.format={sparsity.get('format')!r}: sparse checkpoints are not supported"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(
            "config.json quantization_config.config_groups is empty; expected one NVFP4/MXFP4 weight scheme"
        )
    found = set()
    for name, group in groups.items():
        field = f"config.json quantization_config.config_groups.{name}"
        weights = group.get("weights")
        if weights is None:
            raise ValueError(f"{field}.weights is null (activation-only quantization); not supported")
        fmt = _weights_format(weights, f"{field}.weights")
        stored = group.get("format") or qc.get("format")
        if stored not in (None, REGISTRY[fmt].ct_name):
            raise ValueError(
                f"{field}.format={stored!r} does not match its {fmt} weights; expected {REGISTRY[fmt].ct_name!r}"
            )
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                warnings.warn(
                    f"{field}.{act} is quantized in the checkpoint; qerl-jax loads the {fmt} weights and runs activations unquantized",
                    stacklevel=2,
                )
        found.add(fmt)
    if len(found) > 1:
        raise ValueError(f"config.json quantization_config.config_groups mixes formats {sorted(found)}; expected one")
    if qc.get("kv_cache_scheme") is not None:
        warnings.warn(
            "config.json quantization_config.kv_cache_scheme is set; qerl-jax keeps the kv-cache unquantized",
            stacklevel=2,
        )
    return found.pop()


def _require(tensors: Mapping[str, np.ndarray], key: str, fmt: str) -> np.ndarray:
    if key not in tensors:
        raise ValueError(f"{fmt} tensors need {TENSOR_SUFFIXES[fmt]}; {key!r} is missing (got {sorted(tensors)})")
    return np.asarray(tensors[key])


def packed_from_tensors(tensors: Mapping[str, np.ndarray], fmt: str) -> PackedWeight:
    """One layer's compressed-tensors arrays -> PackedWeight (numpy leaves, on the host).

    tensors: {"weight_packed": uint8 [N, K/2], "weight_scale": [N, K/block],
      "weight_global_scale": float32 [1] (nvfp4 only)}; nvfp4 scales as
      ml_dtypes.float8_e4m3fn (or their raw uint8 bytes), mxfp4 scales uint8.
    Returns a PackedWeight with global_scale float32 [] (1 for mxfp4).
    """
    _check_ct_format(fmt)
    codes = _require(tensors, "weight_packed", fmt)
    scales = _require(tensors, "weight_scale", fmt)
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"weight_packed must be uint8 [N, K/2]; got {codes.dtype} {codes.shape}")
    n, half_k = codes.shape
    block = REGISTRY[fmt].block_size
    if (2 * half_k) % block or scales.shape != (n, 2 * half_k // block):
        raise ValueError(
            f"{fmt} weight_scale must be [N, K/{block}] = [{n}, {2 * half_k // block}] for weight_packed "
            f"{codes.shape} (K={2 * half_k}); got {scales.shape}"
        )
    if fmt == "nvfp4":
        if scales.dtype == np.uint8:
            scales = scales.view(ml_dtypes.float8_e4m3fn)
        if scales.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(f"nvfp4 weight_scale must be float8_e4m3fn; got {scales.dtype}")
        gs = _require(tensors, "weight_global_scale", fmt)
        if gs.size != 1 or not np.issubdtype(gs.dtype, np.floating):
            raise ValueError(f"weight_global_scale must be one float32; got {gs.dtype} {gs.shape}")
        global_scale = gs.astype(np.float32).reshape(())
    else:
        if scales.dtype != np.uint8:
            raise ValueError(f"mxfp4 weight_scale must be uint8 E8M0 exponents; got {scales.dtype}")
        global_scale = np.ones((), np.float32)
    return PackedWeight(codes=codes, scales=scales, global_scale=global_scale, fmt=fmt)


def tensors_from_packed(packed: PackedWeight) -> dict[str, np.ndarray]:
    """One layer's PackedWeight ([N, K/2] codes) -> the arrays compressed-tensors stores.

    nvfp4: weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
    weight_global_scale float32 [1]; mxfp4: weight_packed, weight_scale uint8 [N, K/32].
    """
    _check_ct_format(packed.fmt)
    codes, scales, gs = jax.device_get((packed.codes, packed.scales, packed.global_scale))
    codes, scales, gs = np.asarray(codes), np.asarray(scales), np.asarray(gs)
    if codes.ndim != 2:
        raise ValueError(f"tensors_from_packed takes one layer's weight ([N, K/2] codes); got codes {codes.shape}")
    out = {"weight_packed": codes.astype(np.uint8)}
    if packed.fmt == "nvfp4":
        out["weight_scale"] = scales.astype(ml_dtypes.float8_e4m3fn)
        out["weight_global_scale"] = gs.astype(np.float32).reshape(1)
    else:
        out["weight_scale"] = scales.astype(np.uint8)
    return out


_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_safetensors(path: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, numpy array) from a safetensors file, one tensor at a time, float8 too."""
    header = safetensors_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        data_start = 8 + n
        for name in names if names is not None else header:
            if name not in header:
                raise KeyError(f"{path} has no tensor {name!r}")
            info = header[name]
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            f.seek(data_start + begin)
            buf = bytearray(end - begin)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            yield name, np.frombuffer(buf, dtype=_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
