"""compressed-tensors checkpoint interop: config block, format detection, tensor round trips."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qerl_jax import quant
from qerl_jax.quant import compressed_tensors as qct

torch = pytest.importorskip("torch")
compressed_tensors = pytest.importorskip("compressed_tensors")


def _reference_config(fmt: str, ignore: list[str], tmp_path) -> dict:
    """The quantization_config compressed-tensors writes into config.json for a preset."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme({"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt], ["Linear"])
    scheme.format = qct.REGISTRY[fmt].ct_name
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=qct.REGISTRY[fmt].ct_name,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=config).update_config(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantization_config_matches_compressed_tensors(fmt, tmp_path):
    ignore = ["lm_head", "model.layers.0.mlp.gate"]
    ours = qct.quantization_config(fmt, ignore=ignore)
    ref = _reference_config(fmt, ignore, tmp_path)
    # "version" is provenance (CT_VERSION's note): ours is the release we reproduce, whatever is installed;
    # every format field must equal what the installed release writes.
    assert ours["version"] == qct.CT_VERSION and ref["version"] == compressed_tensors.__version__
    assert {k: v for k, v in ours.items() if k != "version"} == {k: v for k, v in ref.items() if k != "version"}
    assert json.loads(json.dumps(ours)) == ours  # plain JSON


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantization_config_is_parsed_by_compressed_tensors(fmt):
    """transformers' CompressedTensorsConfig + compressed-tensors read it back as the preset."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from transformers import CompressedTensorsConfig

    compressor = ModelCompressor.from_compression_config(
        CompressedTensorsConfig.from_dict(qct.quantization_config(fmt))
    )
    group = compressor.quantization_config.config_groups["group_0"]
    preset = preset_name_to_scheme({"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt], ["Linear"])
    # (compared serialized: a symmetric scheme's zp_dtype is not stored, so it reloads as a default)
    assert group.weights.model_dump() == preset.weights.model_dump()
    assert group.weights.scale_dtype == preset.weights.scale_dtype
    assert group.input_activations is None and compressor.quantization_config.ignore == ["lm_head"]
    assert qct.detect_format({"quantization_config": qct.quantization_config(fmt)}) == fmt


def test_quantization_config_rejects_formats_without_representation():
    with pytest.raises(ValueError, match="'nf4' has no compressed-tensors representation"):
        qct.quantization_config("nf4")
    with pytest.raises(ValueError, match="unknown format 'bf16'"):
        qct.quantization_config("bf16")


# A real-world llm-compressor NVFP4A16 config of 2025 (older serialization, extra null fields).
_OLD_NVFP4 = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 16,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "tensor_group",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "nvfp4-pack-quantized",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _with_weights(**changes) -> dict:
    cfg = json.loads(json.dumps(_OLD_NVFP4))
    cfg["config_groups"]["group_0"]["weights"].update(changes)
    return {"quantization_config": cfg}


def test_detect_format_supported():
    assert qct.detect_format({"model_type": "qwen2"}) is None
    assert qct.detect_format({"quantization_config": _OLD_NVFP4}) == "nvfp4"
    assert qct.detect_format({"quantization_config": qct.quantization_config("mxfp4")}) == "mxfp4"
    # NVFP4 W4A4 (quantized activations): the weights load, with a warning.
    w4a4 = json.loads(json.dumps(_OLD_NVFP4))
    w4a4["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4, "type": "float", "dynamic": "local"}
    with pytest.warns(UserWarning, match="input_activations is quantized"):
        assert qct.detect_format({"quantization_config": w4a4}) == "nvfp4"


@pytest.mark.parametrize(
    "config,match",
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq' is not supported"),
        (
            {"quantization_config": {"quant_method": "bitsandbytes", "bnb_4bit_quant_type": "nf4"}},
            "quant_method='bitsandbytes'",
        ),
        (
            _with_weights(type="int", num_bits=4, strategy="group", group_size=128),
            "type='int', num_bits=4 is not supported",
        ),
        (_with_weights(type="int", num_bits=8, strategy="channel", group_size=None), "type='int', num_bits=8"),
        (_with_weights(num_bits=8, strategy="tensor", group_size=None), "type='float', num_bits=8"),
        (_with_weights(group_size=128, strategy="group"), "group_size=128, strategy='group' are not supported"),
        (_with_weights(symmetric=False), "symmetric=False"),
        (_with_weights(actorder="group"), "actorder='group'"),
    ],
)
def test_detect_format_rejects_unsupported_schemes(config, match):
    with pytest.raises(ValueError, match=match):
        qct.detect_format(config)


def test_detect_format_rejects_mixed_transforms_and_sparsity():
    mixed = json.loads(json.dumps(_OLD_NVFP4))
    mixed["config_groups"]["group_1"] = qct.quantization_config("mxfp4")["config_groups"]["group_0"]
    mixed["format"] = "mixed-precision"
    with pytest.raises(ValueError, match="group_0.format='mixed-precision'|mixes formats"):
        qct.detect_format({"quantization_config": mixed})
    mixed["format"] = None
    with pytest.raises(ValueError, match=r"mixes formats \['mxfp4', 'nvfp4'\]"):
        qct.detect_format({"quantization_config": mixed})
    with pytest.raises(ValueError, match="transform_config"):
        qct.detect_format({"quantization_config": {**_OLD_NVFP4, "transform_config": {"config_groups": {"u": {}}}}})
    with pytest.raises(ValueError, match="sparsity_config.format='sparse-24-bitmask'"):
        qct.detect_format({"quantization_config": {**_OLD_NVFP4, "sparsity_config": {"format": "sparse-24-bitmask"}}})
    with pytest.raises(ValueError, match="format='mxfp4-pack-quantized' does not match its nvfp4"):
        qct.detect_format({"quantization_config": {**_OLD_NVFP4, "format": "mxfp4-pack-quantized"}})


# ----------------------------------------------------------------------------------------------
# Tensors <-> PackedWeight <-> safetensors.


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _packed(fmt: str) -> quant.PackedWeight:
    w = jax.random.normal(jax.random.PRNGKey(3), (48, 128)) * jnp.exp(jax.random.normal(jax.random.PRNGKey(4), (48, 1)))
    return quant.quantize(w.astype(jnp.bfloat16), fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_tensors_round_trip_through_safetensors(fmt, tmp_path):
    packed = _packed(fmt)
    tensors = qct.tensors_from_packed(packed)
    expected = {
        "nvfp4": {
            "weight_packed": (np.uint8, (48, 64)),
            "weight_scale": (ml_dtypes.float8_e4m3fn, (48, 8)),
            "weight_global_scale": (np.float32, (1,)),
        },
        "mxfp4": {"weight_packed": (np.uint8, (48, 64)), "weight_scale": (np.uint8, (48, 4))},
    }[fmt]
    assert {k: (v.dtype, v.shape) for k, v in tensors.items()} == {
        k: (np.dtype(d), s) for k, (d, s) in expected.items()
    }
    path = str(tmp_path / "layer.safetensors")
    safetensors.numpy.save_file({f"model.layers.0.mlp.up_proj.{k}": v for k, v in tensors.items()}, path)
    # torch reads the dtypes compressed-tensors uses.
    from safetensors.torch import load_file

    torch_dtypes = {k.rsplit(".", 1)[1]: v.dtype for k, v in load_file(path).items()}
    assert torch_dtypes["weight_packed"] == torch.uint8
    assert torch_dtypes["weight_scale"] == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
    read = {k.rsplit(".", 1)[1]: v for k, v in qct.read_safetensors(path)}
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and read[k].shape == v.shape
        np.testing.assert_array_equal(read[k].view(np.uint8), v.view(np.uint8))
    back = qct.packed_from_tensors(read, fmt)
    assert back.fmt == fmt and back.global_scale.shape == ()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(packed)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(back)), np.asarray(quant.dequantize(packed)))


def test_read_safetensors_matches_torch(tmp_path):
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    arrays = {
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "f32": rng.standard_normal((2,)).astype(np.float32),
        "u8": np.arange(7, dtype=np.uint8),
        "i64": np.arange(3, dtype=np.int64),
        "f16": rng.standard_normal((1, 2, 3)).astype(np.float16),
    }
    path = str(tmp_path / "x.safetensors")
    safetensors.numpy.save_file(arrays, path)
    read = dict(qct.read_safetensors(path))
    ref = load_file(path)
    assert set(read) == set(arrays)
    for k, v in arrays.items():
        assert read[k].dtype == v.dtype and read[k].shape == v.shape
        np.testing.assert_array_equal(read[k].view(np.uint8), v.view(np.uint8))
        np.testing.assert_array_equal(
            read[k].view(np.uint8).reshape(-1), ref[k].contiguous().view(torch.uint8).numpy().reshape(-1)
        )
    assert [k for k, _ in qct.read_safetensors(path, ["u8"])] == ["u8"]
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        list(qct.read_safetensors(path, ["nope"]))


def test_packed_from_tensors_accepts_raw_fp8_bytes():
    tensors = qct.tensors_from_packed(_packed("nvfp4"))
    raw = {**tensors, "weight_scale": tensors["weight_scale"].view(np.uint8)}
    back = qct.packed_from_tensors(raw, "nvfp4")
    assert back.scales.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(back.scales.view(np.uint8), raw["weight_scale"])


def test_packed_from_tensors_errors():
    t = qct.tensors_from_packed(_packed("nvfp4"))
    with pytest.raises(ValueError, match="'weight_global_scale' is missing"):
        qct.packed_from_tensors({k: v for k, v in t.items() if k != "weight_global_scale"}, "nvfp4")
    with pytest.raises(ValueError, match=r"weight_scale must be \[N, K/16\] = \[48, 8\]"):
        qct.packed_from_tensors({**t, "weight_scale": t["weight_scale"][:, :4]}, "nvfp4")
    with pytest.raises(ValueError, match="weight_packed must be uint8"):
        qct.packed_from_tensors({**t, "weight_packed": t["weight_packed"].astype(np.int32)}, "nvfp4")
    with pytest.raises(ValueError, match="nvfp4 weight_scale must be float8_e4m3fn; got float32"):
        qct.packed_from_tensors({**t, "weight_scale": t["weight_scale"].astype(np.float32)}, "nvfp4")
    m = qct.tensors_from_packed(_packed("mxfp4"))
    with pytest.raises(ValueError, match="mxfp4 weight_scale must be uint8"):
        qct.packed_from_tensors({**m, "weight_scale": m["weight_scale"].astype(np.float32)}, "mxfp4")
    with pytest.raises(ValueError, match="'nf4' has no compressed-tensors representation"):
        qct.packed_from_tensors(m, "nf4")
    with pytest.raises(ValueError, match="'nf4' has no compressed-tensors representation"):
        qct.tensors_from_packed(_packed("nf4"))
    stacked = quant.quantize(jnp.ones((2, 16, 64)), "nvfp4")
    with pytest.raises(ValueError, match=r"one layer's weight \(\[N, K/2\] codes\)"):
        qct.tensors_from_packed(stacked)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qct.detect_format({"quantization_config": qct.quantization_config("nvfp4")})  # no warning
