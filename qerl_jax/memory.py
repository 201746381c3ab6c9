"""Memory plan: the bytes a QeRL run needs on each device, and whether (and how) it fits.

`plan_memory` adds up, in bytes, everything a GRPO step keeps on a device, from the shapes
alone (the model config and the run's `PlanInputs`, whose mesh sizes split the weights over
"model" and the batch over "data"; no arrays are built). A step has two phases
that never overlap in time, so

  persistent   = frozen base (packed or bf16 linears, bf16 embeddings, biases, norms)
                 + LoRA params + AdamW moments
  rollout peak = persistent + KV cache + rollout activations + per-layer copies
                 (+ one dequantized layer); the KV cache and activations are the rollout
                 engine's own estimate (`qerl_jax.rollout.budget.rollout_memory`)
  train peak   = persistent + LoRA gradients + training activations (+ one dequantized layer)
  total        = max(rollout peak, train peak)

Every term is documented on the function that computes it (`frozen_terms`, `lora_param_bytes`,
`rollout_terms`, `train_terms`, `dequant_workspace`). The weight, LoRA, optimizer and KV cache
terms are exact array sizes; the activation terms are estimates of what XLA keeps live (checked
against measured peaks by `benchmarks/scale.py`). `fit` chooses the training micro-batch and the
rollout rows (max_batch) for a device (with rl.micro_batch_size = 0 and rl.logprob_chunk = 0, the
largest micro-batch and log-prob chunk that fit) and, when nothing fits, names the config value to
lower. What a run settles on is passed on as a `Resolved`, beside the config (which keeps what was
written).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from qerl_jax.models.qwen2 import (
    ATTENTION_MODES,
    PROJECTIONS,
    ModelConfig,
    kv_head_shards,
    projection_shapes,
    remat_mode,
)
from qerl_jax.projections import COLUMN_PARALLEL
from qerl_jax.quant.formats import CONFIG_FORMATS, FORMATS, REGISTRY
from qerl_jax.quant.packed import splits_over
from qerl_jax.rollout import budget as rollout_budget
from qerl_jax.rollout import scheduler as rollout_scheduler

DENSE_BYTES = 2  # bf16 weights and activations
LORA_BYTES = 4  # LoRA params, their gradients and AdamW moments are float32
LOGIT_BYTES = 4  # logits are float32
GLOBAL_SCALE_BYTES = 4  # float32 global_scale, one per matrix
# Attention keeps float32 scores and bfloat16 probabilities per (head, query, key).
ATTN_SCORE_BYTES = 4 + 2
# The config fields `fit` names when something must be lowered.
FIELD_MICRO_BATCH = "rl.micro_batch_size"
FIELD_MAX_BATCH = "rollout.max_batch"
FIELD_NEW_TOKENS = "rollout.max_new_tokens"
FIELD_QUANT = "model.quant"
FIELD_LOGPROB_CHUNK = "rl.logprob_chunk"
FIELD_LORA_RANK = "lora.rank"
FIELD_REMAT = "rl.remat"
# `fit(remat_fallback=True)` keeps the "proj" remat (projection outputs saved) down to micro-batches
# of this many tokens before it falls back to "full" (smaller matmuls lose more than the recompute).
PROJ_REMAT_MIN_TOKENS = 2048
# What rl.micro_batch_size = 0 and rl.logprob_chunk = 0 (auto) resolve to where the device reports no
# memory size (CPU): the sizes the training step was tuned with.
DEFAULT_MICRO_BATCH = 8
DEFAULT_LOGPROB_CHUNK = 256
# Auto micro-batches stop at this many tokens (rows x row slots): past it the matmuls are large
# enough to keep the device busy, and a larger micro-batch only adds empty rows (a step pads its
# packed rows up to a multiple of the micro-batch).
AUTO_MICRO_BATCH_TOKENS = 32768
GIB = 1024**3


def packed_matrix_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one W [N, K] stored as a `PackedWeight` of format `fmt`.

    codes N * K/2 (uint8, two 4-bit codes per byte) + scales N * K/block * scale bytes
    + one float32 global scale:
      nvfp4: N*K/2 + N*K/16 (fp8)     = 4.5 bits/weight
      mxfp4: N*K/2 + N*K/32 (uint8)   = 4.25 bits/weight
      nf4:   N*K/2 + 4*N*K/64 (f32)   = 4.5 bits/weight
    """
    if fmt not in FORMATS:
        raise ValueError(f"packed format {fmt!r} is not supported; expected one of {FORMATS}")
    block = REGISTRY[fmt].block_size
    if k % block:
        raise ValueError(f"{fmt} needs in-features K divisible by its block size {block}; got K={k}")
    return n * (k // 2) + n * (k // block) * REGISTRY[fmt].scale_bytes + GLOBAL_SCALE_BYTES


def linear_weight_bytes(n: int, k: int, quant: str) -> int:
    """Bytes of one W [N, K]: packed for a 4-bit format, N*K*2 for "bf16"."""
    return n * k * DENSE_BYTES if quant == "bf16" else packed_matrix_bytes(n, k, quant)


def layer_activation_elements(config: ModelConfig, num_lora_targets: int = 0, lora_rank: int = 0) -> int:
    """Activation elements per token that one decoder layer's forward keeps for its backward.

    x1 = rms_norm(h) (D) + q, k, v before and q, k after rotary (2*Hq + 3*Hkv) + attention output
    (Hq) + residual after attention (D) + x2 = rms_norm (D) + gate, up, silu(gate)*up (3*I)
    + layer output (D) + each LoRA intermediate x @ A.T (r per target)
      = 4*D + 3*Hq + 3*Hkv + 3*I + targets*r,
    with Hq = heads*head_dim, Hkv = kv_heads*head_dim. Attention scores are counted apart.
    """
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return 4 * d + 3 * hq + 3 * hkv + 3 * inter + num_lora_targets * lora_rank


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a memory plan is computed from besides the model: the run's sizes and settings.

    Shared by `plan_memory` and `fit` (which re-plans with `dataclasses.replace` of some sizes).
    Checked on construction (a ValueError names the field); a None size is derived and a size is
    capped, so the fields always hold the sizes the plan is built with.

    quant: "bf16" (dense base) or a packed 4-bit format ("nvfp4" | "mxfp4" | "nf4").
    quant_skip: projection names kept bf16 when quantizing. "embed" and "lm_head" may be listed but
      are bf16 either way (the model reads them as dense matrices).
    lora_rank, lora_targets: LoRA rank r and the projections that carry an adapter (rank 0: none,
      and lora_targets becomes ()).
    rollout_batch: sequences generated per step (prompts x group size) = the training batch.
    max_batch: sequences generated at once (None or more than the batch: the whole batch).
    group_size: samples per prompt; the rollout prefills each prompt once for its group, so a chunk
      of B sequences prefills ceil(B / group_size) prompts (1: every row is prefilled).
    prompt_len, max_new_tokens: the KV cache holds S = prompt_len + max_new_tokens slots. The
      rollout pads them to its shape buckets (prompts to a power of two, new tokens to a multiple
      of 64): pass bucketed sizes for an exact cache term.
    micro_batch_size: packed rows per forward/backward of the training step (`rl.packing`: several
      sequences' real tokens share a row).
    train_seq_len: slots per packed row (None: prompt_len + max_new_tokens, what the training loop
      packs into).
    remat: per-layer gradient checkpointing in the training forward: "full" (or True), "proj"
      (projection outputs saved too) or "none" (or False); see `models.qwen2.REMAT_MODES`. Kept as
      the mode's name.
    attention: the training forward's attention, "xla" (scores materialized) or "flash".
    logprob_chunk: sequence positions whose logits are materialised at once (None: all; at most
      train_seq_len).
    backend: "xla" dequantizes one layer's packed weights to bf16 before its matmuls; "pallas"
      dequantizes inside the kernel (no workspace).
    train_norms: the per-layer RMSNorm scales train beside LoRA (config lora.train_norms).
    data_shards, model_shards: the mesh's "data" and "model" sizes; every term is per device. A
      data shard rolls out its own block of the batch (max_batch is per shard, at most its
      ceil(rollout_batch / data_shards) sequences) and a micro-batch is split over the data
      shards. Over "model" the base is tensor parallel (`sharding`'s "tp" rules: q/k/v/gate/up
      split along N, o/down along K, embed/lm_head along the vocabulary, each only where the
      dimension divides; LoRA follows its base), and so are the training logits (vocabulary)
      and the rollout's KV cache (kv heads, `rollout.programs.cache_sharding`). The rollout's
      other arrays and the training's hidden states are counted whole on each model device
      (replicated there, or sharded where XLA chooses: an upper bound).
    """

    quant: str = "nvfp4"
    quant_skip: tuple[str, ...] = ("embed", "lm_head")
    lora_rank: int = 32
    lora_targets: tuple[str, ...] = PROJECTIONS
    rollout_batch: int = 64
    max_batch: int | None = None
    group_size: int = 1
    prompt_len: int = 512
    max_new_tokens: int = 1024
    micro_batch_size: int = 8
    train_seq_len: int | None = None
    remat: bool | str = True
    attention: str = "xla"
    logprob_chunk: int | None = 256
    backend: str = "xla"
    train_norms: bool = False
    data_shards: int = 1
    model_shards: int = 1
    fp8_copies: bool = False

    def __post_init__(self):
        self._check_names()
        _positive("rollout_batch", self.rollout_batch)
        _positive("data_shards", self.data_shards)
        _positive("model_shards", self.model_shards)
        _positive("group_size", self.group_size)
        if self.max_batch is not None:
            _positive(FIELD_MAX_BATCH, self.max_batch)
        _positive("prompt_len", self.prompt_len)
        _positive(FIELD_NEW_TOKENS, self.max_new_tokens)
        _positive(FIELD_MICRO_BATCH, self.micro_batch_size)
        remat = remat_mode(self.remat)
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention {self.attention!r} is not supported; expected one of {ATTENTION_MODES}")
        t = self.prompt_len + self.max_new_tokens if self.train_seq_len is None else self.train_seq_len
        _positive("train_seq_len", t)
        if self.logprob_chunk is not None:
            _positive(FIELD_LOGPROB_CHUNK, self.logprob_chunk)
        derived = dict(
            quant_skip=tuple(self.quant_skip),
            lora_targets=tuple(self.lora_targets) if self.lora_rank else (),
            max_batch=self.shard_batch if self.max_batch is None else min(self.max_batch, self.shard_batch),
            train_seq_len=t,
            remat=remat,
            logprob_chunk=t if self.logprob_chunk is None else min(self.logprob_chunk, t),
            train_norms=bool(self.train_norms),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # a frozen dataclass sets its derived fields so

    def _check_names(self) -> None:
        if self.quant not in CONFIG_FORMATS:
            raise ValueError(f"{FIELD_QUANT} {self.quant!r} is not supported; expected one of {CONFIG_FORMATS}")
        if self.backend not in ("xla", "pallas"):
            raise ValueError(f"backend {self.backend!r} is not supported; expected 'xla' or 'pallas'")
        unknown = set(self.lora_targets) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"lora_targets {sorted(unknown)} are not projections; expected a subset of {PROJECTIONS}")
        unknown = set(self.quant_skip) - set(PROJECTIONS) - {"embed", "lm_head"}
        if unknown:
            raise ValueError(f"quant_skip {sorted(unknown)} unknown; expected 'embed', 'lm_head' or projection names")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"{FIELD_LORA_RANK} must be an int >= 0; got {self.lora_rank!r}")

    def quant_of(self, projection: str) -> str:
        """The storage of a projection's weights: "bf16" if skipped, else `quant`."""
        return "bf16" if projection in self.quant_skip else self.quant

    @property
    def shard_batch(self) -> int:
        """Sequences one data shard rolls out per step."""
        return -(-self.rollout_batch // self.data_shards)

    def device_shape(self, projection: str, n: int, k: int) -> tuple[int, int]:
        """(N, K) of a projection's weight on one model device: N split for a column-parallel
        projection, K for a row-parallel one (whole blocks of a packed format), where it divides."""
        m = self.model_shards
        fmt = self.quant_of(projection)
        block = 1 if fmt == "bf16" else REGISTRY[fmt].block_size
        if projection in COLUMN_PARALLEL:
            return (n // m, k) if splits_over(n, k, -2, m, block) else (n, k)
        return (n, k // m) if splits_over(n, k, -1, m, block) else (n, k)

    def device_vocab(self, vocab: int) -> int:
        """Vocabulary rows of embed / lm_head (and columns of the logits) on one model device."""
        return vocab // self.model_shards if vocab % self.model_shards == 0 else vocab


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per term of a QeRL run on one device (see the module docstring for the phases and
    the `*_terms` functions for each term's formula)."""

    config: ModelConfig
    inputs: PlanInputs  # what the plan was built from, so `fit` can re-plan
    base_linear: int
    embeddings: int
    biases_norms: int
    lora_params: int
    optimizer_state: int
    lora_grads: int
    kv_cache: int
    rollout_activations: int
    rollout_layer_copies: int
    train_saved_activations: int
    train_layer_activations: int
    train_logits: int
    dequant_workspace: int
    train_sequence_arrays: int = 0
    fp8_copies: int = 0
    device_bytes: int | None = None

    @property
    def persistent(self) -> int:
        """Arrays alive for the whole run: frozen weights (and their FP8 copies), LoRA params and AdamW moments."""
        return (
            self.base_linear
            + self.fp8_copies
            + self.embeddings
            + self.biases_norms
            + self.lora_params
            + self.optimizer_state
        )

    @property
    def rollout_peak(self) -> int:
        return (
            self.persistent
            + self.kv_cache
            + self.rollout_activations
            + self.rollout_layer_copies
            + self.dequant_workspace
        )

    @property
    def train_activations(self) -> int:
        return (
            self.train_saved_activations + self.train_layer_activations + self.train_logits + self.train_sequence_arrays
        )

    @property
    def train_peak(self) -> int:
        return self.persistent + self.lora_grads + self.train_activations + self.dequant_workspace

    @property
    def total(self) -> int:
        """Peak bytes of a GRPO step: the larger of the two phases."""
        return max(self.rollout_peak, self.train_peak)

    @property
    def fits(self) -> bool | None:
        """Whether `total` is within `device_bytes` (None when the device size is unknown)."""
        return None if self.device_bytes is None else self.total <= self.device_bytes

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every term in bytes plus the inputs."""
        terms = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "inputs")}
        derived = ("persistent", "rollout_peak", "train_activations", "train_peak", "total", "fits")
        inputs = {f.name: getattr(self.inputs, f.name) for f in dataclasses.fields(self.inputs)}
        return {
            "inputs": {k: list(v) if isinstance(v, tuple) else v for k, v in inputs.items()},
            **terms,
            **{k: getattr(self, k) for k in derived},
        }

    def table(self) -> str:
        """A human-readable table of the terms in GiB."""
        i, c = self.inputs, self.config
        rows = self._rollout_rows() + self._train_rows()
        if self.device_bytes is not None:
            rows.append(("device limit", self.device_bytes))
        title = (
            f"memory plan: L={c.num_hidden_layers} D={c.hidden_size} I={c.intermediate_size} V={c.vocab_size} "
            f"quant={i.quant} rollout={i.rollout_batch} seqs (max_batch {i.max_batch}) "
            f"micro-batch={i.micro_batch_size}"
            + (
                f"; per device of a mesh data={i.data_shards} x model={i.model_shards}"
                if i.data_shards * i.model_shards > 1
                else ""
            )
        )
        width = max(len(name) for name, _ in rows)
        lines = [title, "-" * (width + 14)]
        for name, nbytes in rows:
            lines.append(f"{name:<{width}}  {nbytes / GIB:9.2f} GiB")
        if self.device_bytes is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"{'verdict':<{width}}  {verdict} ({self.total / self.device_bytes:.0%} of the device)")
        return "\n".join(lines)

    def _rollout_rows(self) -> list[tuple[str, int]]:
        """The table's rows of the persistent terms and the rollout phase."""
        i = self.inputs
        embeddings = "embeddings + lm_head (bf16)" if not self.config.tie_word_embeddings else "embeddings (bf16, tied)"
        lora = f"LoRA params (f32, r={i.lora_rank}, {len(i.lora_targets)} targets)" + (
            " + trained norms" if i.train_norms else ""
        )
        fp8_rows = [("their FP8 copies for the train step (W and W.T, E4M3)", self.fp8_copies)] if i.fp8_copies else []
        return [
            (f"base linear weights ({i.quant})", self.base_linear),
            *fp8_rows,
            (embeddings, self.embeddings),
            ("biases + norms (bf16)", self.biases_norms),
            (lora, self.lora_params),
            ("AdamW moments (f32, 2x)", self.optimizer_state),
            ("= persistent", self.persistent),
            (f"KV cache ({i.max_batch} seqs x {i.prompt_len + i.max_new_tokens} tokens)", self.kv_cache),
            ("rollout activations", self.rollout_activations),
            ("per-layer copies (dense linears, biases, norms, LoRA)", self.rollout_layer_copies),
            ("dequantized layer (xla backend)", self.dequant_workspace),
            ("= rollout phase peak", self.rollout_peak),
        ]

    def _train_rows(self) -> list[tuple[str, int]]:
        """The table's rows of the training phase and the total."""
        i = self.inputs
        saved = (
            f"saved layer inputs{' + projection outputs' if i.remat == 'proj' else ''} "
            f"(micro-batch {i.micro_batch_size} x {i.train_seq_len})"
        )
        return [
            ("LoRA gradients + accumulator (f32)", self.lora_grads),
            (saved, self.train_saved_activations),
            ("one layer recomputed" if i.remat != "none" else "all layers' activations", self.train_layer_activations),
            (f"log-prob chunk logits ({i.logprob_chunk} tokens/seq)", self.train_logits),
            (f"per-sequence grids ({i.rollout_batch} seqs x {i.train_seq_len}, f32)", self.train_sequence_arrays),
            ("= train phase peak", self.train_peak),
            ("TOTAL (max of the phases)", self.total),
        ]


# Per-sequence [B, T] float32/int32 arrays of the packed train step (`rl.step`): 3 batch inputs, 2
# accumulators, 6 grid temporaries of a micro-step (source slots, response mask, old log-probs, the
# gathered log-probs and entropies, the in-micro-batch mask) and the log-probs' cotangent.
SEQUENCE_GRID_ARRAYS = 12


def plan_memory(config: ModelConfig, inputs: PlanInputs, device_bytes: int | None = None) -> MemoryPlan:
    """The memory plan of a GRPO run of `config` with `inputs`; all sizes in bytes.

    Each term's formula is on the function that computes it: `frozen_terms`, `lora_param_bytes`
    (lora_params; optimizer_state and lora_grads are twice it), `rollout_terms`, `train_terms`,
    `dequant_workspace`. device_bytes: the device's memory, only recorded for `fits` and the table.
    """
    shapes = {p: inputs.device_shape(p, n, k) for p, (n, k) in projection_shapes(config).items()}
    lora_params = lora_param_bytes(config, inputs, shapes)
    return MemoryPlan(
        config=config,
        inputs=inputs,
        **frozen_terms(config, inputs, shapes),
        lora_params=lora_params,
        optimizer_state=2 * lora_params,  # AdamW first and second moments
        lora_grads=2 * lora_params,  # the micro-batch gradient and the float32 accumulator
        **rollout_terms(config, inputs, shapes, lora_params),
        **train_terms(config, inputs, shapes),
        dequant_workspace=dequant_workspace(inputs, shapes),
        device_bytes=device_bytes,
    )


def _bias_elements(c: ModelConfig) -> int:
    return (
        c.num_hidden_layers * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        if c.attention_bias
        else 0
    )


def frozen_terms(c: ModelConfig, inputs: PlanInputs, shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The frozen base's bytes (L layers, D hidden, V vocab, H heads, KVH kv heads, hd head_dim).

    base_linear: sum over the 7 projections of L * `linear_weight_bytes(N, K, quant)` (a projection
      in `quant_skip` is bf16: N*K*2).
    embeddings: V*D*2 for embed plus V*D*2 for an untied lm_head (always bf16).
    biases_norms: L*(H + 2*KVH)*hd*2 q/k/v biases (attention_bias) + (2*L + 1)*D*2 RMSNorm scales.
    fp8_copies: with inputs.fp8_copies, the train step's E4M3 copies of every projection
      (`linear.fp8_train_base`: W and W.T, one byte a weight each, float32 scales per row of each):
      L * (2*N*K + 4*(N + K)).
    """
    n_layers, d = c.num_hidden_layers, c.hidden_size
    return dict(
        base_linear=sum(n_layers * linear_weight_bytes(n, k, inputs.quant_of(p)) for p, (n, k) in shapes.items()),
        fp8_copies=sum(n_layers * (2 * n * k + 4 * (n + k)) for n, k in shapes.values()) if inputs.fp8_copies else 0,
        embeddings=(1 if c.tie_word_embeddings else 2) * inputs.device_vocab(c.vocab_size) * d * DENSE_BYTES,
        biases_norms=(_bias_elements(c) + (2 * n_layers + 1) * d) * DENSE_BYTES,
    )


def lora_param_bytes(c: ModelConfig, inputs: PlanInputs, shapes: dict[str, tuple[int, int]]) -> int:
    """Sum over the targets of L * r * (N + K) * 4 (A [r, K] and B [N, r], float32), plus with
    train_norms the float32 masters of the trained scales, 2 * L * D * 4."""
    n_layers = c.num_hidden_layers
    lora = sum(n_layers * inputs.lora_rank * (shapes[p][0] + shapes[p][1]) for p in inputs.lora_targets) * LORA_BYTES
    return lora + ((2 * n_layers * c.hidden_size * LORA_BYTES) if inputs.train_norms else 0)


def rollout_terms(
    c: ModelConfig, inputs: PlanInputs, shapes: dict[str, tuple[int, int]], lora_params: int
) -> dict[str, int]:
    """The rollout phase's terms beside the persistent arrays.

    kv_cache: 2 (k and v) * L * B * S * KVH * hd * 2 (bf16), B = max_batch, S = prompt_len +
      max_new_tokens: the chunk's cache (one copy: the rollout updates it in place). kv_cache and
      rollout_activations are `rollout.budget.rollout_memory`'s terms, the estimate the rollout
      itself sizes its rows with (admissions of `scheduler.layout`'s rows and prompts, compaction
      into its smaller buckets).
    rollout_activations: the per-row state plus the largest program's temporaries: an admission (a
      prefill of its prompts: their caches, one layer's activations and scores, logits), a decode
      step (float32 logits and sampling, attention scores over the cache) or a compaction (the
      smaller bucket's cache).
    rollout_layer_copies: the per-layer buffers the unrolled decode copies once per rollout
      (`rollout.weights.split_layers`): bf16 linears (all of them for quant="bf16", the
      `quant_skip` ones otherwise; packed weights are read in place), biases, the 2*L norms and the
      LoRA params.
    """
    lay = rollout_scheduler.layout(inputs.max_batch, group_size=inputs.group_size)
    rollout = rollout_budget.rollout_memory(
        c,
        inputs.max_batch,
        inputs.prompt_len,
        inputs.max_new_tokens,
        admit_rows=lay.admit_rows,
        admit_prompts=lay.admit_prompts,
        compact_rows=lay.smaller[0] if lay.smaller else 0,
    )
    n_layers = c.num_hidden_layers
    dense_linear = sum(
        n_layers * linear_weight_bytes(n, k, "bf16") for p, (n, k) in shapes.items() if inputs.quant_of(p) == "bf16"
    )
    norms_biases = (_bias_elements(c) + 2 * n_layers * c.hidden_size) * DENSE_BYTES
    return dict(
        kv_cache=rollout.kv_cache // kv_head_shards(c.num_key_value_heads, inputs.model_shards),
        rollout_activations=rollout.row_state + rollout.work,
        rollout_layer_copies=dense_linear + norms_biases + lora_params,
    )


def train_terms(c: ModelConfig, inputs: PlanInputs, shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The training phase's activation terms (M = micro_batch_size, T = train_seq_len).

    train_saved_activations: with remat, (L + 1) * M*T*D*2 (every layer's input hidden state plus
      the final one), plus for "proj" L * M*T*N*2 (every projection's bf16 output, N the sum of the
      projections' out features). Without remat: included in the next term.
    train_layer_activations: with remat, one layer recomputed in the backward, M*T*E*2 + M*H*T*T*6
      (E = `layer_activation_elements`; M*H*T*4 with "flash" attention: no scores, a float32
      logsumexp). Its cotangents are made and consumed one op at a time and add little: on an H100
      the whole training term matched XLA's memory analysis of the jitted train step within 5% for
      Qwen2.5-14B and 32B shapes, M=8, T=1536. Without remat: L + 1 such layers (every layer's
      activations plus one layer's cotangents).
    train_logits: M * C * V * 4 * 3, C = logprob_chunk: float32 logits of a chunk, the log-softmax
      temporary and their cotangent.
    train_sequence_arrays: the packed step's per-sequence [B, T] arrays (B = rollout_batch):
      SEQUENCE_GRID_ARRAYS * B*T*4 (the batch's token_index, response_mask, old_logp; the log-prob
      and entropy accumulators; the micro-step's grid temporaries and the log-prob cotangent),
      alive in every micro-step whatever the micro-batch.
    """
    n_layers, d = c.num_hidden_layers, c.hidden_size
    m, t = -(-inputs.micro_batch_size // inputs.data_shards), inputs.train_seq_len
    scores = m * c.num_attention_heads * t * (4 if inputs.attention == "flash" else t * ATTN_SCORE_BYTES)
    e_layer = layer_activation_elements(c, len(inputs.lora_targets), inputs.lora_rank)
    layer_fwd = m * t * e_layer * DENSE_BYTES + scores
    if inputs.remat != "none":
        saved = (n_layers + 1) * m * t * d * DENSE_BYTES
        if inputs.remat == "proj":
            saved += n_layers * m * t * sum(n for n, _ in shapes.values()) * DENSE_BYTES
        layer = layer_fwd
    else:
        saved, layer = 0, (n_layers + 1) * layer_fwd
    return dict(
        train_saved_activations=saved,
        train_layer_activations=layer,
        train_logits=3 * m * inputs.logprob_chunk * inputs.device_vocab(c.vocab_size) * LOGIT_BYTES,
        train_sequence_arrays=SEQUENCE_GRID_ARRAYS * inputs.shard_batch * t * 4,
    )


def dequant_workspace(inputs: PlanInputs, shapes: dict[str, tuple[int, int]]) -> int:
    """With a 4-bit base and the "xla" backend, one layer's quantized projections dequantized to
    bf16: sum of N*K*2 (0 otherwise)."""
    if inputs.backend != "xla":
        return 0
    return sum(shapes[p][0] * shapes[p][1] for p in PROJECTIONS if inputs.quant_of(p) != "bf16") * DENSE_BYTES


def device_memory_bytes(device=None) -> int | None:
    """The allocator's limit of `device` (default: the first device), or None if not reported.

    On GPU this is `memory_stats()["bytes_limit"]`, i.e. XLA_PYTHON_CLIENT_MEM_FRACTION of the
    physical memory (75% by default); CPU devices report nothing.
    """
    import jax  # noqa: PLC0415 (the planning itself needs no jax)

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (some backends raise instead of returning None)
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


class DoesNotFitError(ValueError):
    """The run cannot fit on the device; the message names the config value to lower."""


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` settled on: the (possibly lowered or auto-chosen) sizes and the plan built with them."""

    micro_batch_size: int
    max_batch: int
    remat: str  # the training remat mode (see `fit`'s remat_fallback)
    plan: MemoryPlan
    changed: tuple[str, ...]  # config fields that were lowered
    message: str
    logprob_chunk: int = DEFAULT_LOGPROB_CHUNK  # positions per LM-head chunk the plan was built with


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The sizes a run trains and rolls out with, as its memory plan settled them: the config's auto
    values (rl.micro_batch_size = 0, rl.logprob_chunk = 0, rl.remat = "auto") chosen and sizes that
    do not fit lowered. The run's config keeps what was written; these are passed beside it."""

    micro_batch_size: int  # packed rows per micro-step of the train step
    logprob_chunk: int  # positions per LM-head chunk of the train step
    remat: str  # the train forward's remat mode, one of `models.qwen2.REMAT_MODES`
    max_batch: int  # rollout rows at once; 0: the rollout sizes its rows to the free memory itself


def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [k for k in range(min(n, at_most), 0, -1) if n % k == 0]


def _multiples(ks: list[int], multiple: int) -> list[int]:
    return [k for k in ks if k % multiple == 0]


def micro_batch_candidates(rollout_batch: int, train_seq_len: int, multiple: int = 1) -> list[int]:
    """The micro-batches rl.micro_batch_size = 0 (auto) chooses from, largest first.

    Divisors of the rollout batch (a step packs at most one row per sequence, so it never needs
    more rows; a divisor leaves no empty rows when every sequence fills a row of its own) that are
    multiples of `multiple` (mesh.data: each micro-batch is split over the data devices), of at most
    AUTO_MICRO_BATCH_TOKENS tokens (rows x train_seq_len slots).
    """
    cap = max(multiple, AUTO_MICRO_BATCH_TOKENS // train_seq_len)
    return _multiples(_divisors_desc(rollout_batch, cap), multiple)


def default_micro_batch(rollout_batch: int, multiple: int = 1) -> int:
    """What auto resolves to on a device of unknown size: the largest divisor of the rollout batch of
    at most DEFAULT_MICRO_BATCH rows that is a multiple of `multiple` (DEFAULT_MICRO_BATCH if none)."""
    fitting = _multiples(_divisors_desc(rollout_batch, max(DEFAULT_MICRO_BATCH, multiple)), multiple)
    return fitting[0] if fitting else DEFAULT_MICRO_BATCH


def logprob_chunk_candidates(train_seq_len: int) -> list[int]:
    """The log-prob chunks rl.logprob_chunk = 0 (auto) chooses from, largest first: powers of two
    below the T - 1 predicted positions of a row (a chunk of all of them takes the unchunked path,
    whose logits stay alive for the backward: not what the plan's chunk term counts)."""
    out, c = [], 1
    while c < train_seq_len - 1:
        out.append(c)
        c *= 2
    return out[::-1] or [1]


def _gib(x: int) -> str:
    return f"{x / GIB:.1f} GiB"


@dataclasses.dataclass(frozen=True)
class _Search:
    """`fit`'s re-plans of one run at other sizes, against a budget of bytes."""

    config: ModelConfig
    inputs: PlanInputs  # the planned sizes; `replan` changes some of them
    device_bytes: int
    budget: int  # device_bytes less the margin
    where: str  # the device and budget, for messages

    def replan(self, micro_batch_size: int, max_batch: int, remat: str | None = None, logprob_chunk: int | None = None):
        sizes = dict(
            micro_batch_size=micro_batch_size,
            max_batch=max_batch,
            remat=remat or self.inputs.remat,
            logprob_chunk=logprob_chunk or self.inputs.logprob_chunk,
        )
        return plan_memory(self.config, dataclasses.replace(self.inputs, **sizes), self.device_bytes)

    def rollout_peak(self, rows: int) -> int:
        return self.replan(1, rows).rollout_peak  # the rollout phase does not depend on the micro-batch

    def train_peak(self, micro_batch_size: int, remat: str | None = None, logprob_chunk: int | None = None) -> int:
        # nor the training phase on the rollout rows
        return self.replan(micro_batch_size, self.inputs.max_batch, remat, logprob_chunk).train_peak

    def first_fitting(self, candidates: list[int], peak: Callable[[int], int]) -> int | None:
        return next((k for k in candidates if peak(k) <= self.budget), None)


def fit(
    plan: MemoryPlan,
    device_bytes: int | None = None,
    *,
    adjust: bool = True,
    margin: float = 0.05,
    remat_fallback: bool = False,
    auto_micro_batch: bool = False,
    auto_logprob_chunk: bool = False,
    micro_batch_multiple: int = 1,
) -> FitResult:
    """Picks (adjust=True) or validates (adjust=False) the micro-batch and the rollout rows (max_batch).

    remat_fallback: with a "proj" plan, the training phase keeps "proj" at the largest micro-batch
    of at least PROJ_REMAT_MIN_TOKENS tokens that fits, else takes "full" (and its largest fitting
    micro-batch); the choice is `FitResult.remat`.
    auto_micro_batch: the micro-batch is the largest of `micro_batch_candidates` that fits (with
      adjust=True), not at most the planned one (rl.micro_batch_size = 0).
    auto_logprob_chunk: with the micro-batch chosen at the planned chunk, the chunk is then the
      largest of `logprob_chunk_candidates` that fits beside it (smaller than the planned one only
      where no micro-batch fits with it) (rl.logprob_chunk = 0).
    micro_batch_multiple: every micro-batch chosen is a multiple of it (mesh.data).

    The budget is `device_bytes * (1 - margin)` (the margin covers XLA workspace and
    fragmentation); `device_bytes` defaults to `plan.device_bytes`, then to the first JAX
    device's `bytes_limit`. The two phases are independent: max_batch is the largest
    divisor of the rollout batch, at most the planned one, whose rollout phase fits; the
    micro-batch likewise for the training phase.

    Raises:
      DoesNotFitError: nothing fits (or, with adjust=False, the planned sizes do not); the
        message names the config value to lower and by how much memory is short.
      ValueError: the device size is unknown.
    """
    search = _search(plan, device_bytes, margin)
    _positive("micro_batch_multiple", micro_batch_multiple)
    _check_persistent(plan, search)
    i = plan.inputs
    rows = search.first_fitting(
        _divisors_desc(i.shard_batch, i.max_batch) if adjust else [i.max_batch], search.rollout_peak
    )
    candidates = _micro_batches_to_try(i, adjust, auto_micro_batch, micro_batch_multiple)
    mb, remat, chunk = _choose_train(search, candidates, remat_fallback, auto_logprob_chunk and adjust)
    search = dataclasses.replace(search, inputs=dataclasses.replace(i, remat=remat, logprob_chunk=chunk))
    problems = _rollout_problems(search, rows, adjust) + _train_problems(search, mb, adjust, micro_batch_multiple)
    if problems:
        raise DoesNotFitError(f"does not fit on a {search.where}: " + "; ".join(problems))
    final = search.replan(mb, rows)
    changed, message = _fit_message(i, final, auto_micro_batch, auto_logprob_chunk)
    return FitResult(
        micro_batch_size=mb,
        max_batch=rows,
        remat=remat,
        plan=final,
        changed=changed,
        message=message,
        logprob_chunk=chunk,
    )


def _micro_batches_to_try(i: PlanInputs, adjust: bool, auto: bool, multiple: int) -> list[int]:
    """`fit`'s micro-batch candidates, largest first: the planned one alone (adjust=False), every
    candidate size (auto), else the divisors of the batch up to the planned one; multiples of
    `multiple`."""
    if not adjust:
        return [i.micro_batch_size]
    if auto:
        return micro_batch_candidates(i.rollout_batch, i.train_seq_len, multiple)
    return _multiples(_divisors_desc(i.rollout_batch, i.micro_batch_size), multiple)


def _search(plan: MemoryPlan, device_bytes: int | None, margin: float) -> _Search:
    """`fit`'s search on `device_bytes` (or the plan's, or the first JAX device's) less `margin`."""
    if device_bytes is None:
        device_bytes = plan.device_bytes if plan.device_bytes is not None else device_memory_bytes()
    if device_bytes is None:
        raise ValueError("the device memory size is unknown (no bytes_limit in memory_stats); pass device_bytes")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1); got {margin}")
    budget = int(device_bytes * (1 - margin))
    where = f"{_gib(device_bytes)} device ({_gib(budget)} usable with a {margin:.0%} margin)"
    return _Search(plan.config, plan.inputs, device_bytes, budget, where)


def _check_persistent(plan: MemoryPlan, search: _Search) -> None:
    """Raises DoesNotFitError when the arrays alive for the whole run alone are over the budget."""
    if plan.persistent <= search.budget:
        return
    i = plan.inputs
    frozen = plan.base_linear + plan.embeddings + plan.biases_norms
    if i.quant == "bf16":
        hint = f"set {FIELD_QUANT}='nvfp4' (now 'bf16'), or shard the model over more GPUs"
    elif frozen > search.budget:
        hint = f"shard the model over more GPUs (mesh.model): the {i.quant} base alone needs {_gib(frozen)}"
    else:
        hint = f"lower {FIELD_LORA_RANK} (now {i.lora_rank}) or fewer LoRA targets"
    raise DoesNotFitError(
        f"the frozen weights and LoRA state alone need {_gib(plan.persistent)} on a {search.where}: {hint}"
    )


def _largest_micro_batch(
    search: _Search, candidates: list[int], chunk: int, remat_fallback: bool
) -> tuple[int | None, str]:
    """(the largest fitting micro-batch of `candidates` or None, remat) with log-prob chunks of `chunk`."""
    remat = search.inputs.remat
    if remat_fallback and remat == "proj":
        efficient = [k for k in candidates if k * search.inputs.train_seq_len >= PROJ_REMAT_MIN_TOKENS]
        mb = search.first_fitting(efficient, lambda k: search.train_peak(k, "proj", chunk))
        if mb is not None:
            return mb, "proj"
        remat = "full"  # the projection outputs fit no efficient micro-batch
    return search.first_fitting(candidates, lambda k: search.train_peak(k, remat, chunk)), remat


def _choose_train(
    search: _Search, candidates: list[int], remat_fallback: bool, auto_chunk: bool
) -> tuple[int | None, str, int]:
    """(micro-batch or None, remat, log-prob chunk) of the training phase: the largest fitting
    micro-batch at the planned chunk; with auto_chunk, then the largest chunk that fits beside it,
    or where none fits, the largest smaller chunk beside which some micro-batch fits."""
    planned = search.inputs.logprob_chunk
    mb, remat = _largest_micro_batch(search, candidates, planned, remat_fallback)
    if not auto_chunk:
        return mb, remat, planned
    chunks = logprob_chunk_candidates(search.inputs.train_seq_len)
    if mb is None:  # smaller chunks, until some micro-batch fits beside them
        for chunk in (c for c in chunks if c < planned):
            mb, remat = _largest_micro_batch(search, candidates, chunk, remat_fallback)
            if mb is not None:
                return mb, remat, chunk
        return None, remat, planned
    larger = [c for c in chunks if c > planned]
    return mb, remat, search.first_fitting(larger, lambda c: search.train_peak(mb, remat, c)) or planned


def _rollout_problems(search: _Search, rows: int | None, adjust: bool) -> list[str]:
    """Why no rollout rows fit (none when `rows` does), naming the config value to lower."""
    if rows is not None:
        return []
    i = search.inputs
    best = None if adjust else search.first_fitting(_divisors_desc(i.rollout_batch, i.max_batch), search.rollout_peak)
    if best is not None:
        return [
            f"the rollout phase needs {_gib(search.rollout_peak(i.max_batch))}: lower {FIELD_MAX_BATCH} "
            f"from {i.max_batch} to {best}"
        ]
    one = search.replan(1, 1)
    copies = one.persistent + one.rollout_layer_copies + one.dequant_workspace
    if copies > search.budget and i.quant == "bf16":
        return [
            f"the rollout needs {_gib(copies)} before any KV cache (the weights plus their per-layer "
            f"copies for the decode): set {FIELD_QUANT}='nvfp4' (packed weights are read in place), "
            "or shard the model over more GPUs"
        ]
    return [
        f"the rollout of even 1 sequence needs {_gib(one.rollout_peak)} (KV cache {_gib(one.kv_cache)}): "
        f"lower {FIELD_NEW_TOKENS} (now {i.max_new_tokens}) or the prompt length"
    ]


def _train_problems(search: _Search, mb: int | None, adjust: bool, multiple: int) -> list[str]:
    """Why no micro-batch fits (none when `mb` does), naming the config value to lower."""
    if mb is not None:
        return []
    i = search.inputs
    mb0 = i.micro_batch_size
    best = (
        None
        if adjust
        else search.first_fitting(_multiples(_divisors_desc(i.rollout_batch, mb0), multiple), search.train_peak)
    )
    if best is not None:
        return [
            f"the training phase needs {_gib(search.train_peak(mb0))}: lower {FIELD_MICRO_BATCH} from {mb0} to {best}"
        ]
    one = search.replan(1, i.max_batch)
    if one.train_logits >= one.train_activations / 2 and i.logprob_chunk > 1:
        hint = f"lower {FIELD_LOGPROB_CHUNK} (now {i.logprob_chunk})"
    elif i.remat == "none":
        hint = f"set {FIELD_REMAT}=True"
    else:
        hint = f"lower {FIELD_NEW_TOKENS} (now {i.max_new_tokens}; training sequences are {i.train_seq_len} tokens)"
    return [f"training on even 1 sequence needs {_gib(one.train_peak)}: {hint}"]


def _fit_message(
    planned: PlanInputs, final: MemoryPlan, auto_micro_batch: bool, auto_logprob_chunk: bool
) -> tuple[tuple[str, ...], str]:
    """(the config fields lowered, the line that says what `fit` settled on) from the planned inputs
    to the final plan's."""
    got = final.inputs
    changed, notes = [], []
    if got.micro_batch_size != planned.micro_batch_size and not auto_micro_batch:
        changed.append(FIELD_MICRO_BATCH)
        notes.append(f"{FIELD_MICRO_BATCH} {planned.micro_batch_size} -> {got.micro_batch_size}")
    if got.max_batch != planned.max_batch:
        changed.append(FIELD_MAX_BATCH)
        notes.append(f"{FIELD_MAX_BATCH} {planned.max_batch} -> {got.max_batch}")
    message = f"fits: peak {_gib(final.total)} of {_gib(final.device_bytes)}"
    if notes:
        message += "; lowered " + ", ".join(notes)
    chosen = [f"{FIELD_MICRO_BATCH} = {got.micro_batch_size}"] if auto_micro_batch else []
    chosen += [f"{FIELD_LOGPROB_CHUNK} = {got.logprob_chunk}"] if auto_logprob_chunk else []
    if chosen:
        message += "; auto " + ", ".join(chosen)
    if got.remat != planned.remat:
        changed.append(FIELD_REMAT)
        message += f"; {FIELD_REMAT} {planned.remat} -> {got.remat} (projection outputs do not fit)"
    return tuple(changed), message
