"""NVFP4 / MXFP4 / NF4 quantization: bit-exact against compressed-tensors, error bars, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.numerics import _div_rn_integer, exact_div
from qerl_jax import quant
from qerl_jax.quant import compressed_tensors as qct
from qerl_jax.quant import packed as packed_lib
from qerl_jax.quant.formats import E2M1_VALUES, NF4_VALUES
from qerl_jax.quant.nvfp4 import round_to_bf16, round_to_e4m3
from qerl_jax.quant.packed import e8m0_to_f32, unpack_codes

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

_dequantize = jax.jit(quant.dequantize, static_argnums=1)
_CT_SCHEMES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
_COMPRESSORS = {"nvfp4": NVFP4PackedCompressor, "mxfp4": MXFP4PackedCompressor}


# ----------------------------------------------------------------------------------------------
# The reference: llm-compressor's memoryless min-max observer + compressed-tensors' compressor.


def ct_compress(w: torch.Tensor, fmt: str, fused_with: tuple[torch.Tensor, ...] = ()) -> dict:
    """compressed-tensors' compressed state dict of one weight [N, K] (torch, its own dtype).

    The observer statistics run in the weight's dtype, as llm-compressor's do; `fused_with`
    are the other shards (q/k/v, gate/up) whose min/max the nvfp4 global scale also covers.
    """
    scheme = preset_name_to_scheme(_CT_SCHEMES[fmt], ["Linear"])
    block = quant.REGISTRY[fmt].block_size
    groups = w.unflatten(-1, (-1, block))
    state = {"weight": w}
    gs = None
    if fmt == "nvfp4":
        mins = torch.stack([t.min() for t in (w, *fused_with)]).min()
        maxs = torch.stack([t.max() for t in (w, *fused_with)]).max()
        gs = generate_gparam(mins, maxs)
        state["weight_global_scale"] = gs
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    state["weight_scale"] = scale.to(w.dtype)  # llm-compressor stores it in the weight dtype
    return _COMPRESSORS[fmt].compress(state, scheme)


def ct_decompress(sd: dict, fmt: str) -> torch.Tensor:
    scheme = preset_name_to_scheme(_CT_SCHEMES[fmt], ["Linear"])
    return _COMPRESSORS[fmt].decompress(dict(sd), scheme)["weight"]


def ct_to_numpy(sd: dict) -> dict[str, np.ndarray]:
    """A compressed torch state dict -> numpy arrays with compressed-tensors' dtypes."""
    out = {}
    for k, v in sd.items():
        if v.dtype == torch.float8_e4m3fn:
            out[k] = v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        else:
            out[k] = v.numpy()
    return out


def _bits(x) -> np.ndarray:
    """The raw bytes of an array (compares float8 and -0.0 exactly)."""
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def to_jax(w: torch.Tensor) -> jax.Array:
    """A torch weight -> the same values as a jax array of the same dtype."""
    arr = jnp.asarray(w.float().numpy())
    return arr.astype(jnp.bfloat16) if w.dtype == torch.bfloat16 else arr


def assert_packed_equal(packed: quant.PackedWeight, sd: dict, fmt: str) -> None:
    ref = ct_to_numpy(sd)
    np.testing.assert_array_equal(np.asarray(packed.codes), ref["weight_packed"])
    np.testing.assert_array_equal(np.asarray(packed.scales).view(np.uint8), ref["weight_scale"].view(np.uint8))
    if fmt == "nvfp4":
        np.testing.assert_array_equal(np.asarray(packed.global_scale).reshape(1), ref["weight_global_scale"])
    else:
        assert "weight_global_scale" not in ref
        np.testing.assert_array_equal(np.asarray(packed.global_scale), 1.0)


# ----------------------------------------------------------------------------------------------
# Test weights: shapes, outliers, zero blocks, tiny/huge magnitudes, exact rounding ties.


def _weights(case: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if case == "gauss":
        w = randn(32, 128) * 0.02
    elif case == "gauss_8x256":
        w = randn(8, 256)
    elif case == "rowscaled":  # per-row magnitudes over 6 decades
        w = randn(32, 128) * torch.exp(randn(32, 1) * 3)
    elif case == "outliers":
        w = randn(32, 128) * 0.02
        w[3, 17], w[20, 100], w[31, 0] = 30.0, -45.0, 7.0
    elif case == "zero_blocks":
        w = randn(32, 128)
        w[:, 32:64] = 0.0
        w[5] = 0.0
        w[7, 3] = -0.0
    elif case == "tiny_blocks":  # blocks far below the tensor max: their fp8 scale underflows
        w = randn(32, 128)
        w[:, :64] *= 1e-6
    elif case == "all_zero":
        w = torch.zeros(32, 128)
    elif case == "tiny":
        w = randn(32, 128) * 1e-20
    elif case == "huge":
        w = randn(32, 128) * 1e30
    elif case == "ties":  # values on the E2M1 rounding midpoints (block max 6 -> divisor 1)
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0, 6.0, 0.1, 5.5, 2.25, 4.5, 1.0, 0.0])
        row = torch.cat([mids, -mids.flip(0)] * 4)
        w = torch.stack([row, row.roll(3), -row, row * 0.5] * 8)
        w[:, ::64] = 6.0
    else:
        raise ValueError(case)
    return w.to(dtype)


CASES = (
    "gauss",
    "gauss_8x256",
    "rowscaled",
    "outliers",
    "zero_blocks",
    "tiny_blocks",
    "all_zero",
    "tiny",
    "huge",
    "ties",
)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_bit_exact_vs_compressed_tensors(case, dtype, fmt):
    w = _weights(case, DTYPES[dtype])
    sd = ct_compress(w, fmt)
    packed = quant.quantize(to_jax(w), fmt)
    assert_packed_equal(packed, sd, fmt)
    # Dequantized values: ours in float32 == compressed-tensors' bf16 decompression, cast.
    ref = ct_decompress(sd, fmt)
    ours = _dequantize(packed, jnp.float32)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.bfloat16)).view(np.uint16), ref.view(torch.uint16).numpy())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bit_exact_random_sweep_under_jit(fmt):
    """Many random magnitudes (both dtypes), through jax.jit, against the reference."""
    rng = np.random.default_rng(1)
    quantize_jit = jax.jit(quant.quantize, static_argnums=1)
    for trial in range(24):
        dtype = torch.bfloat16 if trial % 2 else torch.float32
        scale = 10.0 ** rng.uniform(-8, 8)
        w = (torch.from_numpy(rng.standard_normal((32, 128)).astype(np.float32)) * scale).to(dtype)
        assert_packed_equal(quantize_jit(to_jax(w), fmt), ct_compress(w, fmt), fmt)


def test_dequantize_float32_matches_compressed_tensors_float32():
    """In float32 too (not only after the bf16 cast of compressed-tensors' decompress)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    w = _weights("rowscaled", torch.float32)
    sd = ct_compress(w, "nvfp4")
    values = unpack_fp4_from_uint8(sd["weight_packed"], *w.shape, dtype=torch.float32)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    ref = ct_dequantize(
        values,
        sd["weight_scale"].float(),
        args=scheme.weights,
        global_scale=sd["weight_global_scale"],
        dtype=torch.float32,
    )
    ours = quant.dequantize(quant.quantize(to_jax(w), "nvfp4"))
    np.testing.assert_array_equal(np.asarray(ours), ref.numpy())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_state_dict_through_packed_from_tensors(fmt):
    w = _weights("outliers", torch.bfloat16)
    sd = ct_compress(w, fmt)
    packed = qct.packed_from_tensors(ct_to_numpy(sd), fmt)
    ref = ct_decompress(sd, fmt)
    ours = quant.dequantize(packed, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), ref.view(torch.uint16).numpy())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_global_scale_matches_reference(dtype):
    """q/k/v sharing one global scale (joint amax), as llm-compressor fuses them for vLLM."""
    shards = [(_weights("rowscaled", DTYPES[dtype]) * s) for s in (1.0, 3.0, 0.2)]
    amax = jnp.max(jnp.stack([jnp.max(jnp.abs(to_jax(s).astype(jnp.float32))) for s in shards]))
    for i, w in enumerate(shards):
        others = tuple(s for j, s in enumerate(shards) if j != i)
        packed = quant.quantize(to_jax(w), "nvfp4", amax=amax)
        assert_packed_equal(packed, ct_compress(w, "nvfp4", fused_with=others), "nvfp4")


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_stacked_layers_equal_per_matrix(fmt):
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 32, 128)) * jnp.array([1.0, 1e-3, 50.0])[:, None, None]
    stacked = quant.quantize(w, fmt)
    assert stacked.codes.shape == (3, 32, 64) and stacked.global_scale.shape == (3,)
    assert stacked.shape == (3, 32, 128)
    for i in range(3):
        single = quant.quantize(w[i], fmt)
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(single)):
            np.testing.assert_array_equal(_bits(a[i]), _bits(b))


# ----------------------------------------------------------------------------------------------
# Building blocks against independent references.


def test_round_to_bf16_and_e4m3_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.uniform(-30, 30, 20000).astype(np.float32),
            np.float32([0.0, -0.0, 1.0, 3.0e38, -3.39e38, 65504.0]),
        ]
    )
    np.testing.assert_array_equal(
        np.asarray(round_to_bf16(jnp.asarray(x))), x.astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    e = np.concatenate(
        [
            np.clip(
                rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.uniform(-4, 3, 20000), -448, 448
            ).astype(np.float32),
            # every E4M3 value and every midpoint between neighbours (ties to even)
            np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)),
        ]
    )
    e = e[np.isfinite(e)]
    grid = np.unique(np.abs(e[-254:]))
    e = np.concatenate([e, (grid[1:] + grid[:-1]) / 2, -(grid[1:] + grid[:-1]) / 2]).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(round_to_e4m3(jnp.asarray(e))), e.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    )


def test_integer_division_is_ieee():
    """The long division used on GPU (XLA's GPU division is not correctly rounded)."""
    rng = np.random.default_rng(0)
    n = 200_000
    a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-15, 15, n)).astype(np.float32)
    b = np.abs(rng.standard_normal(n) * 10.0 ** rng.uniform(-15, 15, n)).astype(np.float32)
    q = (rng.integers(1, 2**12, n) * 2.0 ** rng.integers(-10, 10, n)).astype(np.float32)  # exact quotients
    a, b = (
        np.concatenate([a, q * b, np.float32([0.0, -0.0, 3.0, -3.0])]),
        np.concatenate([b, b, np.float32([7.0, 7.0, 6.0, 6.0])]),
    )
    ref = a / b
    got = np.asarray(jax.jit(_div_rn_integer)(jnp.asarray(a), jnp.asarray(b)))
    normal = np.isfinite(ref) & ((np.abs(ref) >= np.finfo(np.float32).tiny) | (ref == 0))
    assert normal.sum() > 0.9 * len(a)
    np.testing.assert_array_equal(got[normal].view(np.uint32), ref[normal].view(np.uint32))
    np.testing.assert_array_equal(
        np.asarray(exact_div(jnp.asarray(a), jnp.asarray(b)))[normal].view(np.uint32), ref[normal].view(np.uint32)
    )


def test_gpu_division_path_bit_exact(monkeypatch):
    """NVFP4 with the integer division (the non-CPU branch) still equals compressed-tensors."""
    from qerl_jax.quant import nvfp4

    monkeypatch.setattr(
        nvfp4, "exact_div", lambda a, b: _div_rn_integer(*jnp.broadcast_arrays(jnp.float32(a), jnp.float32(b)))
    )
    quantize_int = jax.jit(nvfp4.quantize_nvfp4)
    for case in ("rowscaled", "ties", "tiny_blocks"):
        for dtype in DTYPES.values():
            w = _weights(case, dtype)
            assert_packed_equal(quantize_int(to_jax(w)), ct_compress(w, "nvfp4"), "nvfp4")


def test_e8m0_decode_is_exact():
    e = np.arange(1, 255, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(e8m0_to_f32(jnp.asarray(e))), np.ldexp(np.float32(1), e.astype(np.int32) - 127)
    )
    assert np.isinf(np.asarray(e8m0_to_f32(jnp.uint8(255))))


def test_mxfp4_exponent_rule_rounds_mantissa_ge_1_75_up():
    """compressed-tensors' (and our) MX scale rounds amax to a power of two first: a block max
    of 7 (1.75 * 4) gets scale 2 (values up to 3.5 before rounding), not OCP's floor rule 1."""
    for bmax, expected_scale in [
        (6.0, 1.0),
        (6.99, 1.0),
        (7.0, 2.0),
        (7.5, 2.0),
        (12.0, 2.0),
        (14.0, 4.0),
        (0.75, 0.125),
    ]:
        w = jnp.zeros((1, 32)).at[0, 0].set(bmax)
        packed = quant.quantize(w, "mxfp4")
        assert float(2.0 ** (int(packed.scales[0, 0]) - 127)) == expected_scale, bmax


def test_e2m1_sign_of_zero():
    """Negative values that round to 0 keep the sign bit (code 8); -0.0 itself gets code 0."""
    w = jnp.zeros((1, 16)).at[0, 0].set(6.0).at[0, 1].set(-0.1).at[0, 2].set(0.1).at[0, 3].set(-0.0)
    codes = np.asarray(unpack_codes(quant.quantize(w, "nvfp4").codes))[0, :4]
    np.testing.assert_array_equal(codes, [7, 8, 0, 0])


def test_e2m1_ties_round_to_even():
    """Block max 6 gives global scale 448 and divisor exactly 1, so these are exact ties."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    w = jnp.asarray([ties + [-t for t in ties]], jnp.float32)
    packed = quant.quantize(w, "nvfp4")
    assert float(packed.global_scale) == 448.0 and float(packed.scales[0, 0]) == 448.0
    codes = np.asarray(unpack_codes(packed.codes))[0]
    expected = [0, 2, 2, 4, 4, 6, 6, 7]  # 0, 1, 1, 2, 2, 4, 4, 6
    np.testing.assert_array_equal(codes, expected + [c | 8 for c in expected])


def test_code_tables():
    assert E2M1_VALUES[7] == 6.0 and E2M1_VALUES[15] == -6.0
    assert np.all(np.diff(NF4_VALUES) > 0) and NF4_VALUES[7] == 0.0


def test_nf4_matches_nearest_level_reference():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 256)) * np.exp(rng.standard_normal((16, 1)))).astype(np.float32)
    w[:, 64:128] = 0.0  # all-zero blocks
    packed = quant.quantize(jnp.asarray(w), "nf4")
    blocks = w.reshape(16, 4, 64)
    absmax = np.abs(blocks).max(-1)
    normalized = blocks / np.where(absmax > 0, absmax, 1)[..., None]
    ref_codes = np.argmin(np.abs(normalized[..., None] - NF4_VALUES), axis=-1).reshape(16, 256)
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed.codes)), ref_codes)
    np.testing.assert_array_equal(np.asarray(packed.scales), absmax)
    ref = (NF4_VALUES[ref_codes].reshape(16, 4, 64) * absmax[..., None]).reshape(16, 256)
    np.testing.assert_allclose(np.asarray(quant.dequantize(packed)), ref, rtol=0, atol=0)
    assert np.all(np.asarray(quant.dequantize(packed))[:, 64:128] == 0)


# ----------------------------------------------------------------------------------------------
# Error bars: relative Frobenius error of dequant(quant(W)) on Gaussian weights.

EXPECTED_GAUSSIAN_REL_ERROR = {"nvfp4": 0.0950, "mxfp4": 0.1119, "nf4": 0.0919}


def _rel_error(w: jax.Array, fmt: str) -> float:
    w_hat = _dequantize(quant.quantize(w, fmt), jnp.float32)
    return float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w))


def test_gaussian_error_bars():
    w = jax.random.normal(jax.random.PRNGKey(0), (256, 1024), jnp.float32)
    errors = {fmt: _rel_error(w, fmt) for fmt in quant.FORMATS}
    for fmt, expected in EXPECTED_GAUSSIAN_REL_ERROR.items():
        assert errors[fmt] == pytest.approx(expected, abs=0.003), errors
    assert errors["nvfp4"] < errors["mxfp4"]
    # The error is scale-free: the same weights times 1e-3 (bf16) give the same errors.
    small = (w * 1e-3).astype(jnp.bfloat16).astype(jnp.float32)
    for fmt in quant.FORMATS:
        assert _rel_error(small, fmt) == pytest.approx(errors[fmt], abs=0.002)


# ----------------------------------------------------------------------------------------------
# API and errors.


def test_bf16_and_unknown_formats():
    w = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(ValueError, match="'bf16' is not a quantized format"):
        quant.quantize(w, "bf16")
    with pytest.raises(ValueError, match="unknown quantization format 'int4'"):
        quant.quantize(w, "int4")
    dense = quant.maybe_quantize(w, "bf16")
    assert dense.dtype == jnp.bfloat16 and dense.shape == (4, 64)
    assert quant.is_packed(quant.maybe_quantize(w, "nf4"))


@pytest.mark.parametrize("fmt,k", [("nvfp4", 24), ("mxfp4", 48), ("nf4", 96)])
def test_k_not_multiple_of_block(fmt, k):
    with pytest.raises(ValueError, match=f"K={k} is not a multiple of {quant.REGISTRY[fmt].block_size}"):
        quant.quantize(jnp.ones((4, k)), fmt)


def test_bad_weights():
    w = jnp.ones((4, 64)).at[1, 2].set(jnp.nan)
    with pytest.raises(ValueError, match="weight 'layers.0.q_proj' has non-finite values"):
        quant.quantize(w, "nvfp4", name="layers.0.q_proj")
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize(jnp.ones((4, 64)).at[0, 0].set(-jnp.inf), "mxfp4")
    with pytest.raises(TypeError, match="float dtype"):
        quant.quantize(jnp.ones((4, 64), jnp.int32), "nvfp4")
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        quant.quantize(jnp.ones((64,)), "nvfp4")
    with pytest.raises(ValueError, match="amax only applies to nvfp4"):
        quant.quantize(jnp.ones((4, 64)), "nf4", amax=jnp.float32(1))


def _params(dtype=jnp.bfloat16):
    key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    shapes = {
        "q_proj": (64, 64),
        "k_proj": (32, 64),
        "v_proj": (32, 64),
        "o_proj": (64, 64),
        "gate_proj": (128, 64),
        "up_proj": (128, 64),
        "down_proj": (64, 128),
    }
    layers = {p: {"w": (jax.random.normal(next(key), (2, *s)) * 0.02).astype(dtype)} for p, s in shapes.items()}
    for p in ("q_proj", "k_proj", "v_proj"):
        layers[p]["b"] = jnp.ones((2, shapes[p][0]), dtype)
    layers["k_proj"]["w"] = layers["k_proj"]["w"] * 10  # a larger amax in one fused shard
    base = {"embed": jnp.ones((100, 64), dtype), "lm_head": jnp.ones((100, 64), dtype), "layers": layers}
    norms = {"final_norm": jnp.ones((64,)), "layers": {"input_layernorm": jnp.ones((2, 64))}}
    return {
        "base": base,
        "norms": norms,
        "lora": {"layers": {"q_proj": {"a": jnp.zeros((2, 4, 64)), "b": jnp.zeros((2, 64, 4))}}},
    }


def test_quantize_params_structure_and_fused_scales():
    params = _params()
    q = quant.quantize_params(params, "nvfp4", skip=("embed", "lm_head", "down_proj"))
    layers = q["base"]["layers"]
    assert layers["down_proj"]["w"] is params["base"]["layers"]["down_proj"]["w"]
    assert (
        q["base"]["embed"] is params["base"]["embed"] and q["norms"] is params["norms"] and q["lora"] is params["lora"]
    )
    assert layers["q_proj"]["b"] is params["base"]["layers"]["q_proj"]["b"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"):
        assert quant.is_packed(layers[proj]["w"]) and layers[proj]["w"].fmt == "nvfp4"
    gs = {p: np.asarray(layers[p]["w"].global_scale) for p in layers if quant.is_packed(layers[p]["w"])}
    np.testing.assert_array_equal(gs["q_proj"], gs["k_proj"])
    np.testing.assert_array_equal(gs["q_proj"], gs["v_proj"])
    np.testing.assert_array_equal(gs["gate_proj"], gs["up_proj"])
    # The shared scale is the one of the joint amax (k_proj's, the largest), per layer.
    k_alone = quant.quantize(params["base"]["layers"]["k_proj"]["w"], "nvfp4")
    np.testing.assert_array_equal(gs["q_proj"], np.asarray(k_alone.global_scale))
    assert not np.array_equal(
        gs["q_proj"], np.asarray(quant.quantize(params["base"]["layers"]["q_proj"]["w"], "nvfp4").global_scale)
    )
    # Unfused: each projection equals quantize() of it alone.
    unfused = quant.quantize_params(params, "nvfp4", fuse_global_scale=False)
    alone = quant.quantize(params["base"]["layers"]["q_proj"]["w"], "nvfp4")
    for a, b in zip(jax.tree.leaves(unfused["base"]["layers"]["q_proj"]["w"]), jax.tree.leaves(alone)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_quantize_params_other_formats_and_errors():
    params = _params()
    for fmt in ("mxfp4", "nf4"):
        q = quant.quantize_params(params, fmt)
        assert all(q["base"]["layers"][p]["w"].fmt == fmt for p in q["base"]["layers"])
    dense = quant.quantize_params(_params(jnp.float32), "bf16")
    assert all(dense["base"]["layers"][p]["w"].dtype == jnp.bfloat16 for p in dense["base"]["layers"])
    with pytest.raises(ValueError, match=r"skip must contain \['lm_head'\]"):
        quant.quantize_params(params, "nvfp4", skip=("embed",))
    with pytest.raises(ValueError, match="skip names \\['mlp'\\] are unknown"):
        quant.quantize_params(params, "nvfp4", skip=("embed", "lm_head", "mlp"))
    with pytest.raises(ValueError, match="unknown quantization format"):
        quant.quantize_params(params, "fp8")
    bad = _params()
    bad["base"]["layers"]["o_proj"]["w"] = bad["base"]["layers"]["o_proj"]["w"].at[1, 0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match="'base.layers.o_proj.w' has non-finite values"):
        quant.quantize_params(bad, "nvfp4")
    with pytest.raises(ValueError, match="already quantized"):
        quant.quantize_params(quant.quantize_params(params, "nf4"), "nvfp4")


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_format_record_describes_what_the_quantizer_writes(fmt):
    rec = quant.REGISTRY[fmt]
    w = jnp.asarray(np.random.default_rng(7).standard_normal((4, 128)), jnp.float32)
    p = quant.quantize(w, fmt)
    assert p.format is rec and rec.name == fmt
    assert p.scales.dtype == rec.scale_dtype and p.scales.shape == (4, 128 // rec.block_size)
    assert rec.scale_bytes == np.dtype(p.scales.dtype).itemsize
    codes = np.asarray(unpack_codes(p.codes)).astype(np.int64)
    blocks = np.asarray(quant.dequantize(p), np.float64).reshape(4, -1, rec.block_size)
    scale = np.asarray(packed_lib.block_scales_f32(p), np.float64)[..., None]
    table = np.asarray(rec.code_table, np.float64)
    np.testing.assert_allclose(blocks, (table[codes].reshape(blocks.shape) * scale), rtol=1e-6)
    assert quant.CONFIG_FORMATS == (quant.DENSE, *quant.FORMATS)


def test_splits_over_needs_whole_features_or_whole_blocks():
    splits_over = packed_lib.splits_over
    assert splits_over(64, 96, -2, 4) and not splits_over(66, 96, -2, 4)  # output features
    assert splits_over(64, 96, -1, 4)  # dense K = 96: 4 x 24
    assert not splits_over(64, 96, -1, 4, block_size=16)  # 6 blocks of 16 do not split 4 ways
    assert splits_over(64, 128, -1, 4, block_size=16)  # 8 blocks: 2 each
    assert not splits_over(64, 100, -1, 2, block_size=16)  # K not in whole blocks
