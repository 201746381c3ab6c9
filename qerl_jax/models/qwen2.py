"""The Qwen2 / Qwen2.5 decoder (and Llama, which differs only in flags) in Flax linen.

The module declares no parameters of its own: it reads three separate variable collections,
so the frozen base, the RMSNorm scales and the LoRA adapters stay separate pytrees:

- "base":  embed [V, D], lm_head [V, D] (untied only), layers/{q,k,v,o,gate,up,down}_proj/{w, b}
- "norms": final_norm [D], layers/{input_layernorm, post_attention_layernorm} [D]
- "lora":  layers/<proj>/{a [r, K], b [N, r]} (optional; any subset of the projections)

Per-layer variables are stacked on a leading [L] axis and the layers run under `nn.scan`, so
a 64-layer model compiles one layer body.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from qerl_jax.linear import PROJ_OUT, ByRows, Fused, fused_linear, linear, model_devices, per_model_device, stack_loras
from qerl_jax.projections import COLUMN_PARALLEL, FUSED_GROUPS, PROJECTIONS

ATTENTION_PROJECTIONS = PROJECTIONS[:4]
_MASK_VALUE = -1e30  # finite, so fully masked rows (left padding) give a uniform softmax, not NaN


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    max_position_embeddings: int = 32768
    model_type: str = "qwen2"
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable form of the HF dict
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None


# Per-layer gradient checkpointing of the full-sequence forward (`ForwardOptions.remat`):
#   "none": every layer keeps its activations for the backward;
#   "full": only each layer's input is kept, the layer is recomputed in the backward;
#   "proj": each layer's input and its projections' bf16 outputs (`linear.PROJ_OUT`) are kept, so
#           the recompute runs the norms, RoPE, attention and activations but none of the big matmuls
#           (+ L * tokens * (sum of the projections' N) * 2 bytes; `memory.plan_memory` counts it).
REMAT_MODES = ("none", "full", "proj")
# Attention of the full-sequence forward (`ForwardOptions.attention`):
#   "xla":   scores materialized under any mask (`attention`);
#   "flash": `jax.nn.dot_product_attention` (causal, per-row lengths) on rows shifted so that their
#            real tokens come first: cuDNN's fused flash attention on GPU (no [T, S] scores in
#            memory, the masked half of the square skipped), XLA's implementation elsewhere. Needs
#            each row's real tokens contiguous (left and/or right padding only).
ATTENTION_MODES = ("xla", "flash")


def _flash_implementation(dtype) -> str:
    """cuDNN's fused kernel where it runs (a GPU, 16-bit activations), else XLA's."""
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2 else "xla"


def remat_mode(remat: bool | str) -> str:
    """A remat setting as one of REMAT_MODES (True is "full", False "none")."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_MODES:
        raise ValueError(f"remat {remat!r} is not supported; expected one of {REMAT_MODES} (or a bool)")
    return remat


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Static choices of how the forward runs (not what it computes)."""

    lora_scale: float = 1.0
    backend: str = "xla"  # linear backend: "xla" | "pallas"
    remat: str = "none"  # gradient checkpointing per layer: one of REMAT_MODES
    attention: str = "xla"  # full-sequence attention: one of ATTENTION_MODES
    decode_attention: str = "xla"  # `attend_decode_slots` backend of decode steps (`DecodeSlots`): "xla" | "pallas"
    decode_norm_parts: bool = True  # one-row decode steps: norms in parts around fused projections (`rms_norm_parts`)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N = out features, K = in features) of each projection's weight W [N, K]."""
    d, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    return {
        "q_proj": (q_out, d),
        "k_proj": (kv_out, d),
        "v_proj": (kv_out, d),
        "o_proj": (d, q_out),
        "gate_proj": (inter, d),
        "up_proj": (inter, d),
        "down_proj": (d, inter),
    }


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """float32 [head_dim // 2] inverse frequencies, with the checkpoint's rope scaling applied."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    scaling = dict(config.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * jnp.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = jnp.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return jnp.where(is_medium, smoothed, out)
    raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; expected default, linear or llama3")


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the HF "rotate half" layout; computed in float32."""
    with jax.named_scope("rope"):
        angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
        cos = jnp.cos(angles_BxTxF)[:, :, None, :]
        sin = jnp.sin(angles_BxTxF)[:, :, None, :]
        x = x_BxTxHxD.astype(jnp.float32)
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x_BxTxHxD.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y = x / rms(x) * scale, computed in float32 and cast back to x.dtype.

    Unlike HF's Qwen2RMSNorm (which multiplies by the scale in the activation dtype), the scale
    multiply is float32: AQN's noise (sigma down to 1e-4) lives in the norm scales and would
    otherwise round away in bfloat16 (spacing 2^-8 near 1).
    """
    with jax.named_scope("rms_norm"):
        x32 = x.astype(jnp.float32)
        x_hat = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (scale.astype(jnp.float32) * x_hat).astype(x.dtype)


def rms_norm_parts(x: jax.Array, scale: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """`rms_norm` in two parts, for a matmul between them: (x * scale in x.dtype, float32 1/rms(x)
    [..., 1]). (x * scale) @ W.T * (1/rms) is rms_norm(x) @ W.T but for where x * scale rounds (to
    x.dtype before the 1/rms instead of after).

    The rollout's one-row decode step (`DecoderLayer`) uses it: there XLA computes each projection
    as a reduction, and a norm as two kernels it cannot fuse into that reduction (a sum of squares
    to a scalar, then the scaling); the parts leave the sum of squares alone, the scale multiply
    in the matmul's input and the 1/rms in its output (H100 program, Qwen2.5-1.5B: 2 launches a
    layer fewer; benchmarks/RESULTS.md). At 2 rows and more the norm is one fused kernel already."""
    with jax.named_scope("rms_norm"):
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (scale.astype(jnp.float32) * x32).astype(x.dtype), inv_rms


def attention(q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array, mask_BxTxS: jax.Array) -> jax.Array:
    """Grouped-query softmax attention; scores and softmax in float32. Returns [B, T, H, D]."""
    with jax.named_scope("attention"):
        return _attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS)


def _attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    b, t, h, d = q_BxTxHxD.shape
    kv_heads = k_BxSxKxD.shape[2]
    q = q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxD, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, _MASK_VALUE)
    # Softmax normalized after the PV product: the sum over S and the bf16 weights come out of
    # one fusion, and the division joins the output's (one decode kernel less per layer at B = 1).
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    total_BxKxGxT = jnp.sum(weights, axis=-1)
    out = jnp.einsum(
        "bkgts,bskd->btkgd", weights.astype(v_BxSxKxD.dtype), v_BxSxKxD, preferred_element_type=jnp.float32
    )
    out = out / jnp.moveaxis(total_BxKxGxT, 3, 1)[..., None]
    return out.reshape(b, t, h, d).astype(q_BxTxHxD.dtype)


DECODE_ATTENTION_BACKENDS = ("xla", "pallas")


def attend_decode_slots(
    q_BxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    start_B: jax.Array,
    end_B: jax.Array,
    *,
    backend: str = "xla",
) -> jax.Array:
    """One decode query per row against its own cache slots [start_B[b], end_B[b]); [B, H, D] in q's dtype.

    The one dispatch point of decode-step attention (the model calls it for `DecodeSlots` steps).
    q_BxHxD: H = KVH * G query heads, head h reads KV head h // G. k, v: the caches [B, S, KVH, D].
    start_B, end_B: int32, 0 <= start <= end <= S; a row with end <= start gives zeros. Scores
    and softmax are float32. backend "xla": `decode_attention_reference` (a masked softmax over
    all S slots); "pallas": the kernel `pallas_kernels.decode_attention` (reads only each row's slots).
    """
    with jax.named_scope("attention"):
        if backend == "xla":
            return decode_attention_reference(q_BxHxD, k_BxSxKxD, v_BxSxKxD, start_B, end_B)
        if backend == "pallas":
            try:
                from pallas_kernels.decode_attention import decode_attention as kernel  # noqa: PLC0415
            except ImportError as e:
                raise ValueError(f"decode attention backend 'pallas' needs pallas_kernels.decode_attention: {e}") from e
            return _per_model_device_heads(kernel, k_BxSxKxD.shape[2])(q_BxHxD, k_BxSxKxD, v_BxSxKxD, start_B, end_B)
        raise ValueError(f"unknown decode attention backend {backend!r}; expected one of {DECODE_ATTENTION_BACKENDS}")


def kv_head_shards(num_kv_heads: int, model_devices: int) -> int:
    """The parts the kv heads (the KV cache, the decode attention) split into over `model_devices`
    devices of a tensor-parallel mesh: all of them where they divide the heads, else 1 (whole)."""
    return model_devices if num_kv_heads % model_devices == 0 else 1


def _per_model_device_heads(kernel, kv_heads: int):
    """`kernel` run by each device of the "model" axis on its own kv heads (and their query
    heads), where the tensor-parallel projections and the KV cache leave them; the kernel itself
    where no mesh is set (`jax.sharding.use_abstract_mesh`, the rollout's tensor-parallel shards)
    or its "model" axis does not divide the kv heads. XLA cannot split a custom call: left to
    it, every device gathers the layer's whole cache before the kernel, every decode step."""
    if kv_head_shards(kv_heads, model_devices()) == 1:
        return kernel
    heads, cache, rows = P(None, "model", None), P(None, None, "model", None), P()
    return per_model_device(kernel, (heads, cache, cache, rows, rows), heads)


def decode_attention_reference(q_BxHxD, k_BxSxKxD, v_BxSxKxD, start_B, end_B) -> jax.Array:
    """`pallas_kernels.decode_attention` in jnp, the XLA path and the kernel's reference: a masked
    softmax over every cache slot (the values of `attention` with the mask start <= s < end).

    Written so that XLA keeps the caches in their [B, S, KVH, D] row-major layout: q.k as a
    multiply-reduce over D (the minor axis) and p.v as one batched matmul over the slots against
    V viewed as [B, S, KVH * D], whose [KVH, KVH] head blocks off the diagonal are dropped. The
    einsums of `attention` instead make XLA pick a slot-minor layout for a cache carried through
    the decode loop, and transpose the whole cache into it on entry (on an H100, Qwen2.5-7B, 256
    rows x 2304 slots: a 30 GiB temporary, a second cache); so did scores laid out slot-minor
    here (half a cache: benchmarks/devtools/rollout_memory.py checks). One row (B = 1) takes
    `attention`'s einsums: 3 kernels fewer per layer there, and its cache copy is one row's.
    """
    b, h, d = q_BxHxD.shape
    s, kv_heads = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    g = h // kv_heads
    slots_S = jnp.arange(s)
    valid_BxS = (slots_S[None, :] >= start_B[:, None]) & (slots_S[None, :] < end_B[:, None])
    if b == 1:
        out_BxHxD = _attention(
            q_BxHxD[:, None], k_BxSxKxD.astype(q_BxHxD.dtype), v_BxSxKxD.astype(q_BxHxD.dtype), valid_BxS[:, None]
        )
        return jnp.where((end_B > start_B)[:, None, None], out_BxHxD[:, 0], 0.0).astype(q_BxHxD.dtype)
    q_Bx1xKxGxD = q_BxHxD.reshape(b, 1, kv_heads, g, d).astype(jnp.float32)
    k_BxSxKx1xD = k_BxSxKxD[:, :, :, None, :].astype(jnp.float32)
    scores_BxSxKxG = jnp.sum(q_Bx1xKxGxD * k_BxSxKx1xD, axis=-1) * (d**-0.5)
    scores_BxSxKxG = jnp.where(valid_BxS[:, :, None, None], scores_BxSxKxG, _MASK_VALUE)
    weights_BxSxKxG = jnp.exp(scores_BxSxKxG - jnp.max(scores_BxSxKxG, axis=1, keepdims=True))
    total_BxKxG = jnp.sum(weights_BxSxKxG, axis=1)
    # [B, H, KVH * D]: every query head against every KV head's values; keep h's own (h // G).
    pv_BxHxN = jnp.einsum(
        "bsh,bsn->bhn",
        weights_BxSxKxG.reshape(b, s, h).astype(v_BxSxKxD.dtype),
        v_BxSxKxD.reshape(b, s, kv_heads * d),
        preferred_element_type=jnp.float32,
    )
    own_BxGxDxK = jnp.diagonal(pv_BxHxN.reshape(b, kv_heads, g, kv_heads, d), axis1=1, axis2=3)
    out_BxKxGxD = jnp.moveaxis(own_BxGxDxK, 3, 1) / total_BxKxG[..., None]
    out_BxKxGxD = jnp.where((end_B > start_B)[:, None, None, None], out_BxKxGxD, 0.0)
    return out_BxKxGxD.reshape(b, h, d).astype(q_BxHxD.dtype)


@struct.dataclass
class DecodeSlots:
    """Where a decode step (one new token per row, T = 1) writes and reads each row's cache.

    write_B: int32 slot of the new token's key/value. start_B, end_B: int32, the row attends to
    slots [start_B, end_B) (end_B = write_B + 1 for a decoding row; end_B <= start_B: none).
    Each row's valid slots are contiguous: its left-padded prompt, then its tokens so far.
    """

    write_B: jax.Array
    start_B: jax.Array
    end_B: jax.Array


def fused_name(group: tuple[str, ...]) -> str:
    """The base-variable name of a fused group, e.g. "q_proj+k_proj+v_proj"."""
    return "+".join(group)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then SwiGLU MLP, each with a residual."""

    config: ModelConfig
    options: ForwardOptions

    def _proj(self, name: str, x: jax.Array) -> jax.Array:
        return self._projs((name,), x)[0]

    def _linear(self, name: str, x: jax.Array) -> jax.Array:
        p = self.get_variable("base", name)
        return linear(
            x,
            p["w"],
            bias=p.get("b"),
            lora=self._lora(name),
            lora_scale=self.options.lora_scale,
            backend=self.options.backend,
            parallel="column" if name in COLUMN_PARALLEL else "row",
        )

    def _lora(self, name: str) -> dict[str, jax.Array] | None:
        return self.get_variable("lora", name) if self.has_variable("lora", name) else None

    def _fused(self, names: tuple[str, ...], rows: int) -> Fused | None:
        """The projections `names` as one `Fused` weight for a matmul of `rows` rows, where the base
        variables hold them fused (`fused_name(names)`, e.g. the rollout's decode copies, also of
        a single projection holding its adapter's A); else None."""
        group = fused_name(names)
        if not self.has_variable("base", group):
            return None
        fused = self.get_variable("base", group).get("w")
        while isinstance(fused, ByRows):  # e.g. the wgmma kernel's copy up to its rows, bf16 copies above
            fused = fused.small if rows <= fused.max_rows else fused.large
        return fused if isinstance(fused, Fused) and rows <= fused.max_rows else None

    def _projs(self, names: tuple[str, ...], x: jax.Array, row_scale: jax.Array | None = None) -> list[jax.Array]:
        """The projections `names` of x: one matmul where they are fused (`_fused`), else one each
        (each a fused call of one where its weight is one). row_scale: see `fused_linear` (fused
        projections only)."""
        fused = self._fused(names, x.size // x.shape[-1])
        if fused is None:
            if row_scale is not None:
                raise ValueError(f"a row scale needs the projections {names} fused")
            if len(names) > 1:
                return [self._projs((n,), x)[0] for n in names]
            return [self._linear(names[0], x)]
        # the rollout stores the group's adapters stacked once per call; else stack them here
        lora = self._lora(fused_name(names)) or stack_loras([self._lora(n) for n in names], fused.sizes)
        return fused_linear(
            x,
            fused,
            biases=[self.get_variable("base", n).get("b") for n in names],
            lora=lora,
            lora_scale=self.options.lora_scale,
            backend=self.options.backend,
            row_scale=row_scale,
        )

    def _normed_projs(self, names: tuple[str, ...], h_BxTxD: jax.Array, norm: str, decode: bool) -> list[jax.Array]:
        """The projections `names` of rms_norm(h) with the norm scale `norm`; in a decode step of
        one row over fused projections, the norm in parts around the matmul (`rms_norm_parts`)."""
        scale, eps = self.get_variable("norms", norm), self.config.rms_norm_eps
        rows = h_BxTxD.size // h_BxTxD.shape[-1]
        if decode and rows == 1 and self.options.decode_norm_parts and self._fused(names, rows) is not None:
            x, inv_rms = rms_norm_parts(h_BxTxD, scale, eps)
            return self._projs(names, x, row_scale=inv_rms.reshape(rows, 1))
        return self._projs(names, rms_norm(h_BxTxD, scale, eps))

    @nn.compact
    def __call__(self, h_BxTxD, cache_kv, positions_BxT, kv_valid_BxS, cache_index, segment_ids_BxT=None):
        cfg = self.config
        b, t, _ = h_BxTxD.shape
        decode = isinstance(cache_index, DecodeSlots)
        inv_freq = rope_inv_freq(cfg)
        q, k, v = self._normed_projs(FUSED_GROUPS[0], h_BxTxD, "input_layernorm", decode)
        q = q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q = apply_rope(q, positions_BxT, inv_freq)
        k = apply_rope(k, positions_BxT, inv_freq)

        if segment_ids_BxT is not None:  # packed rows: causal attention within each segment only
            with jax.named_scope("attention"):
                if self.options.attention == "flash" and _flash_implementation(q.dtype) == "cudnn":
                    attn = packed_flash_attention(q, k, v, segment_ids_BxT)
                else:
                    same_BxTxS = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
                    attn = _attention(q, k, v, same_BxTxS & jnp.tri(t, dtype=bool)[None])
            return self._rest(h_BxTxD, attn), None
        if cache_kv is None and self.options.attention == "flash":
            # Rows arrive with their real tokens first (`forward` shifts them): causal attention
            # over each row's first `length` keys is exactly the kv_valid mask's. Padding queries
            # (t >= length) see those keys too: finite values, ignored downstream.
            length_B = jnp.sum(kv_valid_BxS, axis=-1, dtype=jnp.int32)
            with jax.named_scope("attention"):
                attn = jax.nn.dot_product_attention(
                    q,
                    k,
                    v,
                    is_causal=True,
                    key_value_seq_lengths=length_B,
                    implementation=_flash_implementation(q.dtype),
                )
            return self._rest(h_BxTxD, attn), None
        if decode:
            attn, new_cache = _decode_step_attention(q, k, v, cache_kv, cache_index, self.options.decode_attention)
        else:
            if cache_kv is None:
                keys, values, new_cache = k, v, None
            else:
                k_cache, v_cache = cache_kv
                keys = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), cache_index, axis=1)
                values = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), cache_index, axis=1)
                new_cache = (keys, values)
            s = keys.shape[1]
            query_slot_T = cache_index + jnp.arange(t)
            causal_TxS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
            mask_BxTxS = causal_TxS[None] & kv_valid_BxS[:, None, :].astype(bool)
            attn = attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask_BxTxS)
        return self._rest(h_BxTxD, attn, decode), new_cache

    def _rest(self, h_BxTxD: jax.Array, attn_BxTxHxD: jax.Array, decode: bool = False) -> jax.Array:
        """The output projection and residual, then the MLP block (decode: see `_normed_projs`)."""
        b, t, _ = h_BxTxD.shape
        h_BxTxD = h_BxTxD + self._proj("o_proj", attn_BxTxHxD.reshape(b, t, -1))
        gate, up = self._normed_projs(FUSED_GROUPS[1], h_BxTxD, "post_attention_layernorm", decode)
        gated = jax.nn.silu(gate) * up
        return h_BxTxD + self._proj("down_proj", gated)


def _decode_step_attention(q_Bx1xHxD, k_Bx1xKxD, v_Bx1xKxD, cache_kv, slots: DecodeSlots, backend: str):
    """Writes each row's new key/value at its slot write_B, then `attend_decode_slots` over [start_B, end_B)."""
    k_cache, v_cache = cache_kv
    if q_Bx1xHxD.shape[0] == 1:  # one row: a plain dynamic update (a scatter of one row lowers worse on GPU)
        at = (0, slots.write_B[0], 0, 0)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k_Bx1xKxD.astype(k_cache.dtype), at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v_Bx1xKxD.astype(v_cache.dtype), at)
    else:
        rows_B = jnp.arange(q_Bx1xHxD.shape[0])
        k_cache = k_cache.at[rows_B, slots.write_B].set(k_Bx1xKxD[:, 0].astype(k_cache.dtype))
        v_cache = v_cache.at[rows_B, slots.write_B].set(v_Bx1xKxD[:, 0].astype(v_cache.dtype))
    out_BxHxD = attend_decode_slots(q_Bx1xHxD[:, 0], k_cache, v_cache, slots.start_B, slots.end_B, backend=backend)
    return out_BxHxD[:, None], (k_cache, v_cache)


class Qwen2(nn.Module):
    """Embedding -> L decoder layers -> final RMSNorm -> (tied or untied) LM head."""

    config: ModelConfig
    options: ForwardOptions = ForwardOptions()

    @nn.compact
    def __call__(
        self,
        input_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        kv_valid_BxS: jax.Array,
        cache=None,
        cache_index: jax.Array | int | DecodeSlots = 0,
        compute_logits: bool = True,
        segment_ids_BxT: jax.Array | None = None,
    ):
        """Runs the decoder over T new tokens.

        Args:
          input_ids_BxT: int32 token ids.
          positions_BxT: int32 rotary positions (0 for the first real token of each row).
          kv_valid_BxS: bool/int [B, S], which key slots hold real tokens. Without a cache S = T.
            Unused (None) with `DecodeSlots`.
          cache: None, or (k, v) each [L, B, S, KVH, head_dim]; the new keys/values are written
            at slots [cache_index, cache_index + T).
          cache_index: where the new tokens go in the cache (and their causal slot offset); or,
            for one new token per row (T = 1), a `DecodeSlots` of per-row slots.
          compute_logits: False returns the final normed hidden states [B, T, D] instead.
          segment_ids_BxT: packed rows (no cache): int32 ids, a token attends causally only to
            tokens of its own segment (kv_valid_BxS is then unused).
        Returns:
          (float32 logits [B, T, V] or hidden [B, T, D], the updated cache or None).
        """
        cfg = self.config
        base = self.get_variable("base", "embed")
        h = jnp.take(base, input_ids_BxT, axis=0)

        layer_cls = DecoderLayer
        if self.options.remat != "none":
            policy = jax.checkpoint_policies.save_only_these_names(PROJ_OUT) if self.options.remat == "proj" else None
            layer_cls = nn.remat(layer_cls, prevent_cse=False, policy=policy)  # scan already blocks CSE
        layers = nn.scan(
            layer_cls,
            variable_axes={"base": 0, "norms": 0, "lora": 0},
            split_rngs={},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_hidden_layers,
        )(cfg, self.options, name="layers")
        h, new_cache = layers(h, cache, positions_BxT, kv_valid_BxS, cache_index, segment_ids_BxT)

        h = rms_norm(h, self.get_variable("norms", "final_norm"), cfg.rms_norm_eps)
        if not compute_logits:
            return h, new_cache
        head = base if cfg.tie_word_embeddings else self.get_variable("base", "lm_head")
        logits = jnp.einsum("btd,vd->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        return logits, new_cache


def packed_flash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT) -> jax.Array:
    """cuDNN's fused attention over packed rows, causal within each segment; [B, T, H, D]. GPU only;
    `attention` with the block-diagonal causal mask is the reference
    (benchmarks/devtools/packed_attention_check.py).

    The segments go in as a [B, 1, T, T] mask (cuDNN reads it as an additive bias beside its causal
    mask: 2 bytes per score). cuDNN's ragged layout (per-row segment offsets) would need the
    largest segment count as a static bound: with T segments per row its workspace at 7B shapes,
    8 x 2304 tokens, is 1.1 TiB.
    """
    same_segment_Bx1xTxT = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask=same_segment_Bx1xTxT, is_causal=True, implementation="cudnn"
    )


def positions_from_segments(segment_ids_BxT: jax.Array) -> jax.Array:
    """Rotary positions of packed rows: 0 at the first token of each segment (a contiguous run of one id)."""
    t = segment_ids_BxT.shape[1]
    cols_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids_BxT.shape)
    new_BxT = jnp.concatenate(
        [jnp.ones_like(segment_ids_BxT[:, :1], bool), segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1
    )
    start_BxT = jax.lax.cummax(jnp.where(new_BxT, cols_BxT, 0), axis=1)
    return cols_BxT - start_BxT


def positions_from_mask(attention_mask_BxT: jax.Array) -> jax.Array:
    """Rotary positions for a left-padded batch: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def variables(params: dict[str, Any]) -> dict[str, Any]:
    """Our params dict -> the linen variable dict (collections base, norms and lora)."""
    out = {"base": params["base"], "norms": params["norms"]}
    if params.get("lora"):
        out["lora"] = {"layers": params["lora"]["layers"]}
    return out


def forward(
    config: ModelConfig,
    params: dict[str, Any],
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    lora_scale: float = 1.0,
    backend: str = "xla",
    remat: bool | str = False,
    attention: str = "xla",
    compute_logits: bool = True,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Pure full-sequence forward: float32 logits [B, T, V] (or hidden [B, T, D]).

    input_ids int32 [B, T]; attention_mask [B, T] with 0 on (left) padding, all ones if None.
    segment_ids: int32 [B, T] for packed rows (`rl.packing`), instead of attention_mask: each
    contiguous run of one id is a sequence of its own (causal attention within it, positions from 0).
    remat: one of REMAT_MODES (or a bool); attention: one of ATTENTION_MODES ("flash" needs each
    row's real tokens contiguous: left and/or right padding, no holes).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq]; got shape {input_ids.shape}")
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention {attention!r} is not supported; expected one of {ATTENTION_MODES}")
    options = ForwardOptions(lora_scale=lora_scale, backend=backend, remat=remat_mode(remat), attention=attention)
    if segment_ids is not None:
        if segment_ids.shape != input_ids.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} != input_ids shape {input_ids.shape}")
        segment_ids = segment_ids.astype(jnp.int32)
        out, _ = Qwen2(config, options).apply(
            variables(params),
            input_ids.astype(jnp.int32),
            positions_from_segments(segment_ids),
            None,
            compute_logits=compute_logits,
            segment_ids_BxT=segment_ids,
        )
        return out
    ids_BxT, mask_BxT = input_ids.astype(jnp.int32), attention_mask
    if attention == "flash":  # real tokens first in every row (see ATTENTION_MODES); shifted back below
        shift_B = jnp.argmax(mask_BxT.astype(bool), axis=1).astype(jnp.int32)
        ids_BxT, mask_BxT = shift_rows(ids_BxT, shift_B), shift_rows(mask_BxT, shift_B)
    out, _ = Qwen2(config, options).apply(
        variables(params),
        ids_BxT,
        positions_from_mask(mask_BxT),
        mask_BxT.astype(bool),
        compute_logits=compute_logits,
    )
    return shift_rows(out, -shift_B) if attention == "flash" else out


def shift_rows(x_BxT: jax.Array, shift_B: jax.Array) -> jax.Array:
    """out[b, t] = x[b, (t + shift_B[b]) mod T]: each row rotated left by its shift (any trailing dims)."""
    t = x_BxT.shape[1]
    index_BxT = (jnp.arange(t, dtype=jnp.int32)[None, :] + shift_B[:, None]) % t
    index = index_BxT.reshape(index_BxT.shape + (1,) * (x_BxT.ndim - 2))
    return jnp.take_along_axis(x_BxT, index, axis=1)
