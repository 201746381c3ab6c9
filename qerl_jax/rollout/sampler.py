"""Batched KV-cache generation on the (quantized, LoRA-adapted) policy: `generate`.

    batch = generate(config, params, prompt_ids, prompt_mask, key, SamplingConfig(...), group_size=8)
    train = to_train_batch(batch)

`generate` validates its input, plans the call (`plan_rollout`: rows, row buckets, weight
copies, the memory estimate against the budget; all before anything is compiled), prepares the
weights once (`weights.split_layers`), then runs the scheduler (`scheduler.Scheduler`: queue,
retire, refill, compaction) over the device programs (`programs`: admit, decode, compact) and
assembles the `RolloutBatch`. The row order is prompt-major: row b * G + g is sample g of prompt b.

Randomness: sequence r (its row in the full [B * G] output) draws its step-t token with key
fold_in(fold_in(key, s), t), s its stream (`streams[r]`, default r). So results do not depend on
`max_batch`, the row buckets, `share_prefill`, the admission order, or on whether prompts are
passed repeated with group_size 1 or once with group_size G.

Log-probs are those of `sampling.sample`: log_softmax(logits / T) before top-k/top-p.

Compiled programs: one admission and one decode program per row bucket a call reaches (its
rows, then those of `smaller_rows` below them when compacting), per prompt / new-token bucket.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.util
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import fp8, linear
from qerl_jax.models.qwen2 import DECODE_ATTENTION_BACKENDS, ForwardOptions, ModelConfig
from qerl_jax.rollout import budget, programs, scheduler, weights
from qerl_jax.rollout.batch import RolloutBatch, to_train_batch
from qerl_jax.rollout.sampling import SamplingConfig

__all__ = [
    "RolloutBatch",
    "RolloutMonitor",
    "Partial",
    "RolloutOptions",
    "RolloutPart",
    "RolloutPlan",
    "generate",
    "plan_rollout",
    "to_train_batch",
]


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """The engine's rarely changed choices for `generate` (defaults fit training and evaluation).

    backend: the linear backend, "xla" or "pallas".
    cache_dtype: KV cache dtype (bfloat16; float32 for exactness tests).
    memory_budget_bytes: device bytes the rollout may use; default the device's free memory
      when the backend reports it (GPU/TPU), else unchecked.
    share_prefill: prefill a prompt once per admission and copy its cache to the rows of its
      group's sequences (default); False prefills each sequence's prompt (same results).
    batch_sharding: a sharding of the leading (row) axis, e.g. NamedSharding(mesh, P("data")),
      for data-parallel rollouts: the KV cache, the row state and each admission's arrays are
      placed with it (row buckets rounded up to a multiple of its shard count). Place the
      params first (replicated, or `sharding.shard_params`). The samples equal those of one device.
    dense_weights: dequantize the packed linears to bf16 once per call and decode with the dense
      copies (+2 bytes per weight in memory while it runs). None (default) does so where the
      per-step path would dequantize anyway (backend "xla", or "pallas" with a row bucket of at
      least DENSE_FROM_ROWS rows) and the copies fit in the memory budget; else, on "pallas",
      only for the small projections (SMALL_DENSE_WEIGHTS), where the kernel is slower than a
      bf16 dot, unless the wgmma kernel runs them fused with a larger one (k/v with q). A model
      below KERNEL_MIN_LAYER_WEIGHTS packed weights a layer (Qwen2.5 0.5B and 1.5B) decodes
      every bucket from copies of all of them by default (with neither wgmma nor dense_weights
      given), when they fit: its step is bound by its many small kernels, not its weight reads.
    wgmma_weights: repack the NVFP4 projections once per call for the Hopper wgmma decode
      kernel (+4.5 bits per weight while it runs); None (default) does so on a Hopper GPU with
      backend "pallas" and a row bucket of at most WGMMA_MAX_ROWS rows, when the copies fit and
      the model is not below KERNEL_MIN_LAYER_WEIGHTS;
      False never (the Triton kernel reads them in place). The copies of q/k/v and of gate/up
      are concatenated per layer and run as one call each. With bf16 copies as well, buckets
      above the kernel's rows read those; the kernel's buckets leave the small projections on
      their copies, as a call of those buckets alone does.
    smaller_rows: the row buckets the tail is compacted into (those below the call's rows;
      default `scheduler.DEFAULT_SMALLER_ROWS`); () never compacts.
    decode_attention: "xla" (a masked softmax over the whole cache) or "pallas" (the kernel
      reads each row's slots only); None: `decode_attention_backend`.
    min_prompt_len: prompts get at least `scheduler.prompt_bucket(min_prompt_len)` cache slots,
      whatever the call's longest prompt. Callers with a fixed prompt limit pass it (training
      and evaluation: `data.max_prompt_len`), so that every call runs the same programs: by
      default the bucket follows each call's longest prompt, and a batch whose prompts all fit a
      smaller bucket compiles a new set of programs mid-run (60-140 s for the 1.5B).
    fp8_matmul: "auto" | "on" | "off" (`fp8.MODES`): E4M3 copies of the dense layer weights (the
      bf16 copies of a 4-bit base) made once per call, read by matmuls of at least `fp8.MIN_ROWS`
      rows (the prefill, the largest decode buckets) on FP8 tensor cores, activations quantized per
      token (+1 byte per weight while it runs). "auto": for a 4-bit base on a GPU with FP8 tensor
      cores (`fp8.available`). Off by default: see `qerl_jax.fp8` for what is measured.
    norm_parts: in a decode step of one row, each RMSNorm before fused projections in two parts
      around their matmul (`qwen2.rms_norm_parts`: 2 kernel launches a layer fewer, the same
      values but for one bf16 rounding); False keeps the norm whole, as the other programs do.
    """

    backend: str = "xla"
    cache_dtype: Any = jnp.bfloat16
    memory_budget_bytes: int | None = None
    share_prefill: bool = True
    batch_sharding: jax.sharding.Sharding | None = None
    dense_weights: bool | Sequence[str] | None = None
    wgmma_weights: bool | Sequence[str] | None = None
    smaller_rows: Sequence[int] | None = None
    decode_attention: str | None = None
    min_prompt_len: int = 0
    fp8_matmul: str = "off"
    norm_parts: bool = True


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """How a `generate` call runs (chosen before anything is compiled).

    rows: the first row bucket; max_batch: sequences decoded at once in it (<= rows);
    smaller: the buckets the tail is compacted into; admit_rows / admit_prompts: rows and prompts of one admission;
    dense_names / wgmma_names: the weight copies (`weights.decode_weight_names`); memory: the
    estimate (`budget.rollout_memory`, weight copies included); budget: the bytes it had to fit
    (None: unchecked).
    """

    rows: int
    max_batch: int
    smaller: tuple[int, ...]
    admit_rows: int
    admit_prompts: int
    dense_names: tuple[str, ...]
    wgmma_names: tuple[str, ...]
    memory: budget.RolloutMemory
    budget: int | None

    @property
    def buckets(self) -> tuple[int, ...]:
        return (self.rows, *self.smaller)


class RolloutMonitor(Protocol):
    """What `generate` asks while it runs, for a caller that decides which sequences it needs."""

    def finished(self, seqs_K: np.ndarray, tokens_KxM: np.ndarray, lengths_K: np.ndarray) -> None:
        """Sequences (indices of the call's rows) that stopped, with their tokens and lengths."""

    def bounds(self, wait: bool) -> tuple[int, int]:
        """(limit, end): sequences below `limit` may be admitted; those at or past `end` are not
        needed (`end` never grows; `limit` falls only with it). wait: nothing is decoding or admissible, so block until
        something can change (e.g. a pending score arrives), or return the same bounds when
        nothing can."""


@dataclasses.dataclass(frozen=True)
class Partial:
    """Sequences of a call already under way (partial rollouts, `rollout.max_staleness`), K of them.

    seqs_K: the call's rows they are. tokens_KxM / logprobs_KxM: their first lengths_K tokens (M =
    max_new_tokens; >= 1 each) and the sampler's log-probs of them. finished_K: complete (stopped_K:
    by a stop id), reported to the monitor and not decoded again; the others resume (`programs.resume`)
    before any new sequence is admitted, each drawing from its row's stream as if it had not stopped.
    """

    seqs_K: np.ndarray
    tokens_KxM: np.ndarray
    logprobs_KxM: np.ndarray
    lengths_K: np.ndarray
    finished_K: np.ndarray
    stopped_K: np.ndarray

    @classmethod
    def empty(cls, max_new_tokens: int) -> Partial:
        """No sequence under way (K = 0)."""
        none = np.zeros((0,), bool)
        return cls(none.astype(np.int64), np.zeros((0, max_new_tokens), np.int32),
                   np.zeros((0, max_new_tokens), np.float32), none.astype(np.int32), none, none)  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutPart:
    """How a `generate` call fits into a larger rollout (a data shard's rows, DAPO's rounds of prompts);
    the default: the call is the whole rollout.

    streams: int [B * G] the PRNG stream of each output row (default its row index r): a call
      that samples some rows of a larger batch (a data shard's, `rollout.data_parallel`, or
      several rounds of prompts at once) draws the tokens the larger call would for them.
    monitor: told of each sequence as it stops (`RolloutMonitor.finished`), it bounds which
      sequences are admitted and which are still needed (`RolloutMonitor.bounds`): DAPO's
      dynamic sampling decides while the rollout runs. Rows of sequences no longer needed
      stop decoding (their output rows stay empty: length 0); the decode loop hands back
      every MONITOR_STEPS steps to ask.
    expected_seqs: the rows are planned (`plan_rollout`) for at most this many sequences at
      once (default all B * G): a call whose monitor will likely stop it short (DAPO's
      over-provisioned prompts) runs the programs of the batch it expects to need, the rest
      admitted as rows free up.
    partial: sequences already under way (`Partial`; partial rollouts): the finished ones are
      reported to the monitor at once, the others resume first. The call then asks the monitor's
      `done()` whenever it asks its bounds, and ends as soon as it is True: the sequences still
      decoding (or not resumed yet) are paused, returned as a second `Partial`; those never
      admitted have no tokens (length 0). The monitor must not drop sequences (`end` stays N).
    """

    streams: Sequence[int] | np.ndarray | None = None
    monitor: RolloutMonitor | None = None
    expected_seqs: int | None = None
    partial: Partial | None = None


# With a monitor, the decode loop hands back at least every this many steps (to harvest the
# rows that stopped and stop those no longer needed).
MONITOR_STEPS = 128
# Programs `generate` compiles at once (XLA's GPU compiler also autotunes GEMMs on the device
# while it compiles).
COMPILE_THREADS = 4
# plan_rollout's automatic row counts, by the call's shapes: (max_batch, copies chosen to fit).
_AUTO_ROWS: dict[tuple, tuple[int, bool]] = {}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def _row_shards(batch_sharding: jax.sharding.Sharding | None) -> int:
    """Into how many pieces `batch_sharding` splits a leading axis (1 for None)."""
    if batch_sharding is None:
        return 1
    probe = batch_sharding.num_devices  # a length the shard count divides, whatever the mesh
    return probe // batch_sharding.shard_shape((probe,))[0]


def plan_rollout(
    config: ModelConfig,
    params: dict[str, Any],
    num_seqs: int,
    prompt_slots: int,
    new_slots: int,
    *,
    group_size: int = 1,
    max_batch: int | None = None,
    options: RolloutOptions = RolloutOptions(),
) -> RolloutPlan:
    """The rows, buckets and weight copies of a rollout of `num_seqs` sequences (see `generate`).

    max_batch None sizes the rows to the budget (`memory_budget_bytes`, default the device's
    free memory): the largest row bucket whose estimate, the weight copies wanted for its
    buckets included, fits (then, if none does, the largest with the copies that still fit),
    and later calls of the same shapes keep it while it fits (no new programs to compile); on a
    device that reports no memory, every sequence at once. Raises MemoryError when the
    rollout does not fit, naming what to lower.
    """
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 or None; got {max_batch}")
    smaller_rows = scheduler.DEFAULT_SMALLER_ROWS if options.smaller_rows is None else tuple(options.smaller_rows)
    if any(int(b) != b or b < 1 for b in smaller_rows):
        raise ValueError(f"smaller_rows must be positive ints; got {smaller_rows}")
    budget_bytes = options.memory_budget_bytes
    planner = _Planner(
        config, params, prompt_slots, new_slots, group_size, smaller_rows, options,
        limit=budget_bytes if budget_bytes is not None else budget.device_free_bytes(),
        act_dtype=weights.act_dtype_of(params), layer_copies=weights.layer_copy_bytes(params),
        # The wgmma kernel has no per-device form: tensor-parallel weights stay with the Triton one.
        wgmma_weights=False if linear.model_mesh(params) is not None else options.wgmma_weights,
    )  # fmt: skip
    if max_batch is None and planner.limit is not None:
        return _auto_rows(planner, num_seqs)
    chosen = planner.plan(min(num_seqs, max_batch or num_seqs), choose_copies=True)
    if not planner.fits(chosen):
        raise MemoryError(
            f"a rollout of {chosen.rows} rows x ({prompt_slots} prompt + {new_slots} new) slots needs "
            f"about {_size(chosen.memory.total)} (x{budget.MEMORY_MARGIN} margin), over the "
            f"{_size(planner.limit)} budget; lower max_batch (rows decoded at once, now {max_batch}), the group "
            f"size ({group_size}), the prompt batch ({num_seqs // group_size}) or max_new_tokens"
            + (
                f", or pass RolloutOptions(dense_weights=False) ({_size(weights.dense_copy_bytes(params, chosen.dense_names))}"
                " of bf16 copies)"
                if chosen.dense_names
                else ""
            )
        )
    return chosen


def fp8_min_rows(options: RolloutOptions, params: dict[str, Any]) -> int | None:
    """The rows from which the call's matmuls read E4M3 copies (`RolloutOptions.fp8_matmul`); None: no copies.
    Not for tensor-parallel weights (the copies are made per layer of whole weights)."""
    quantized = bool(weights.packed_names(params))
    if linear.model_mesh(params) is not None or not fp8.enabled(options.fp8_matmul, quantized):
        return None
    return fp8.MIN_ROWS


@dataclasses.dataclass(frozen=True)
class _Planner:
    """`plan_rollout`'s settings: the plan of any number of sequences decoded at once, and whether it fits."""

    config: ModelConfig
    params: dict[str, Any]
    prompt_slots: int
    new_slots: int
    group_size: int
    smaller_rows: tuple[int, ...]
    options: RolloutOptions
    limit: int | None  # the bytes the rollout may use (None: unchecked)
    act_dtype: Any  # of the params' activations (`weights.act_dtype_of`)
    layer_copies: int  # bytes of the per-layer copies of the call (`weights.layer_copy_bytes`)
    wgmma_weights: bool | Sequence[str] | None  # options.wgmma_weights; False for tensor-parallel params

    def plan(self, at_once: int, choose_copies: bool) -> RolloutPlan:
        """The plan at `at_once` sequences decoded at once; copies wanted (False) or those that fit (True)."""
        o, params = self.options, self.params
        lay = scheduler.layout(
            at_once,
            group_size=self.group_size,
            smaller_rows=self.smaller_rows,
            share_prefill=o.share_prefill,
            shards=_row_shards(o.batch_sharding),
        )
        mem = budget.rollout_memory(
            self.config,
            lay.rows,
            self.prompt_slots,
            self.new_slots,
            admit_rows=lay.admit_rows,
            admit_prompts=lay.admit_prompts,
            compact_rows=lay.smaller[0] if lay.smaller else 0,
            cache_dtype=o.cache_dtype,
            act_dtype=self.act_dtype,
            weight_copies=self.layer_copies,
        )
        limit = self.limit
        fits = lambda extra: not choose_copies or limit is None or (mem.total + extra) * budget.MEMORY_MARGIN <= limit  # noqa: E731
        dense, wgmma = weights.decode_weight_names(
            params, o.dense_weights, self.wgmma_weights, backend=o.backend, rows=(lay.rows, *lay.smaller), fits=fits
        )
        extra = (
            (weights.fp8_copy_bytes(params, dense) if fp8_min_rows(o, params) else 0)
            + weights.dense_copy_bytes(params, dense)
            + weights.wgmma_copy_bytes(params, wgmma)
            + weights.fused_lora_bytes(params, dense, wgmma)
        )
        mem = dataclasses.replace(mem, weight_copies=mem.weight_copies + extra)
        return RolloutPlan(
            lay.rows, lay.max_batch, lay.smaller, lay.admit_rows, lay.admit_prompts, dense, wgmma, mem, self.limit
        )

    def fits(self, p: RolloutPlan) -> bool:
        return self.limit is None or p.memory.total * budget.MEMORY_MARGIN <= self.limit


def _auto_rows(planner: _Planner, num_seqs: int) -> RolloutPlan:
    """The plan of the most rows that fit the budget, the weight copies wanted first, then those that
    fit; the rows of an earlier call of the same shapes while they fit. MemoryError if one row does not."""
    o = planner.options
    # The same shapes get the same rows while they fit: a row count that moved with the free
    # memory from one call (training step) to the next would compile new programs each time.
    key = (planner.config, scheduler.rows_bucket(num_seqs), planner.prompt_slots, planner.new_slots,
           planner.group_size, planner.smaller_rows, o.share_prefill, o.backend, jnp.dtype(o.cache_dtype).name,
           o.dense_weights, planner.wgmma_weights, _row_shards(o.batch_sharding), o.fp8_matmul)  # fmt: skip
    if key in _AUTO_ROWS:
        chosen = planner.plan(*_AUTO_ROWS[key])
        if planner.fits(chosen):
            return dataclasses.replace(chosen, max_batch=min(chosen.max_batch, num_seqs))
    candidates = sorted({min(num_seqs, r) for r in scheduler.rows_candidates(num_seqs)}, reverse=True)
    for choose_copies in (False, True):
        for at_once in candidates:
            chosen = planner.plan(at_once, choose_copies)
            if planner.fits(chosen):
                _AUTO_ROWS[key] = (at_once, choose_copies)
                return chosen
    one = planner.plan(1, choose_copies=True)
    raise MemoryError(
        f"the rollout does not fit even one sequence at a time (max_batch=None sizes the rows to the budget): "
        f"1 sequence x ({planner.prompt_slots} prompt + {planner.new_slots} new) slots needs about "
        f"{_size(one.memory.total)} (x{budget.MEMORY_MARGIN} margin; weight copies {_size(one.memory.weight_copies)}, "
        f"KV cache {_size(one.memory.kv_cache)}), over the {_size(planner.limit)} budget "
        "(RolloutOptions.memory_budget_bytes, default the free device memory); lower max_new_tokens or the prompt "
        "length, spread the model over more devices (mesh.model), or free device memory (on a GPU JAX takes "
        "XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 by default)"
    )


def _check_prompts(config: ModelConfig, ids: np.ndarray, mask: np.ndarray, max_new: int) -> np.ndarray:
    """Validates left-padded prompts; returns the int32 [B] prompt lengths."""
    if ids.ndim != 2:
        raise ValueError(f"prompt_ids must be [batch, prompt_len]; got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise ValueError(f"prompt_mask shape {mask.shape} != prompt_ids shape {ids.shape}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids is empty (shape {ids.shape}); expected at least one prompt token")
    if not np.all((mask == 0) | (mask == 1)):
        raise ValueError("prompt_mask must hold only 0 (padding) and 1 (real token)")
    lengths = mask.sum(axis=1).astype(np.int32)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"prompt row(s) {empty.tolist()} have no real token (prompt_mask all 0); drop them")
    not_left = np.flatnonzero(np.any(np.diff(mask, axis=1) < 0, axis=1))
    if not_left.size:
        raise ValueError(
            f"prompt row(s) {not_left.tolist()} are not left-padded: the mask must be 0...0 1...1 (pad on the left)"
        )
    if np.any((ids < 0) | (ids >= config.vocab_size)):
        bad = ids[(ids < 0) | (ids >= config.vocab_size)][:5]
        raise ValueError(f"prompt_ids hold ids outside [0, vocab_size={config.vocab_size}): {bad.tolist()}")
    context = config.max_position_embeddings
    too_long = np.flatnonzero(lengths >= context)
    if too_long.size:
        raise ValueError(
            f"prompt row(s) {too_long[:5].tolist()} have {int(lengths[too_long[0]])} tokens, as many as the model's "
            f"context (max_position_embeddings={context}) or more; shorten the prompts (data.max_prompt_len)"
        )
    longest = int(lengths.max())
    if longest + max_new > context:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({max_new}) exceeds the model's "
            f"max_position_embeddings ({context}); shorten the prompt or max_new_tokens"
        )
    return lengths


def _check_limits(limits: Any, num_seqs: int, max_new: int) -> np.ndarray:
    """The int32 [N] per-sequence token limits (default max_new for every sequence)."""
    if limits is None:
        return np.full((num_seqs,), max_new, np.int32)
    arr = np.asarray(limits)
    if arr.shape != (num_seqs,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"max_new_tokens_per_seq must be an int array of shape [{num_seqs}] (one per sequence); "
            f"got {arr.dtype} {arr.shape}"
        )
    if arr.size and (arr.min() < 1 or arr.max() > max_new):
        raise ValueError(
            f"max_new_tokens_per_seq must be in [1, max_new_tokens={max_new}]; got [{arr.min()}, {arr.max()}]"
        )
    return arr.astype(np.int32)


def _check_streams(streams: Any, num_seqs: int) -> np.ndarray:
    """The uint32 [N] PRNG streams of the sequences (default 0..N-1)."""
    if streams is None:
        return np.arange(num_seqs, dtype=np.uint32)
    arr = np.asarray(streams)
    if arr.shape != (num_seqs,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"streams must be an int array of shape [{num_seqs}] (one per sequence); got {arr.dtype} {arr.shape}"
        )
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError(f"streams must be in [0, 2**32); got [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint32)


def decode_attention_backend(requested: str | None) -> str:
    """The decode attention `generate` uses: `requested`, or by default the Pallas kernel
    (`pallas_kernels.decode_attention`) on a GPU, whatever the weights' format (H100, 7B shapes,
    2304 slots: 3.0x XLA's full-cache attention with every slot written, 11x at 256 ragged rows;
    benchmarks/KERNEL_NOTES.md, "Decode attention"), else "xla"."""
    if requested is not None:
        if requested not in DECODE_ATTENTION_BACKENDS:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION_BACKENDS} or None; got {requested!r}")
        return requested
    kernel = importlib.util.find_spec("pallas_kernels.decode_attention") is not None
    return "pallas" if kernel and jax.default_backend() == "gpu" else "xla"


def generate(
    config: ModelConfig,
    params: dict[str, Any],
    prompt_ids: jax.Array | np.ndarray,
    prompt_mask: jax.Array | np.ndarray,
    key: jax.Array,
    sampling: SamplingConfig,
    *,
    group_size: int = 1,
    lora_scale: float = 1.0,
    max_batch: int | None = None,
    max_new_tokens_per_seq: Sequence[int] | np.ndarray | None = None,
    part: RolloutPart = RolloutPart(),
    options: RolloutOptions = RolloutOptions(),
) -> RolloutBatch | tuple[RolloutBatch, Partial]:
    """Samples group_size responses for each of B left-padded prompts.

    Args:
      config, params: the policy ({"base", "norms", optional "lora"}); linears may be dense or
        packed 4-bit, the LoRA delta is added unmerged with `lora_scale`.
      prompt_ids, prompt_mask: int [B, P], left-padded (mask 0...0 1...1 per row).
      key: PRNG key; see the module docstring for how per-row keys derive from it.
      sampling: temperature/top-p/top-k/greedy, max_new_tokens, stop ids.
      group_size: G samples per prompt; the output has B * G rows, prompt-major.
      max_batch: at most this many sequences decode at once (any size, a group may be split
        across refills); None (default) sizes the rows to the memory budget (`plan_rollout`),
        or takes all B * G where the device reports no memory (CPU).
      max_new_tokens_per_seq: int [B * G] each sequence's token limit (<= max_new_tokens); a
        sequence stopped by it is truncated, like one stopped by max_new_tokens.
      part: how the call fits into a larger rollout (`RolloutPart`: its rows' PRNG streams, the
        monitor that may stop it short, the sequences it expects to need, the sequences under way
        it resumes).
      options: the engine's choices (`RolloutOptions`: backend, cache dtype, memory budget,
        row sharding, weight copies, compaction buckets, decode attention).

    The layers run one by one (packed weights read in place, dense weights, norms and LoRA over
    per-layer copies made for the call: +1x those in memory) with per-layer caches (2.5-4x faster
    decode on GPU than a layer scan, see `weights.split_layers`). The call's programs (its
    admission, the decode of every row bucket, the compactions between them) are compiled up
    front, COMPILE_THREADS at once (not with batch_sharding).

    Returns:
      A `RolloutBatch` with N = B * G rows and M = max_new_tokens response columns; with
      `part.partial`, (that batch, the paused `Partial`), the paused rows empty in the batch.

    Long because its docstring documents every argument of the engine's entry point; the body reads
    as its steps: check the input, plan the rows, prepare the weights and programs, decode, assemble.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 or None; got {max_batch}")
    call = _prepare_call(
        config, prompt_ids, prompt_mask, sampling, group_size, lora_scale, max_new_tokens_per_seq, part.streams, options
    )
    monitor, partial = part.monitor, part.partial
    planned = call.total if part.expected_seqs is None else max(1, min(call.total, part.expected_seqs))
    plan = plan_rollout(
        config, params, planned, call.prompt_slots, call.static.new_slots, group_size=group_size,
        max_batch=max_batch, options=options,
    )  # fmt: skip
    dense = plan.dense_names
    run_params = weights.split_layers(
        params, options.backend if dense else None, dense or None, plan.wgmma_names, fp8_min_rows(options, params)
    )
    placement = options.batch_sharding or _committed_placement(run_params)
    with linear.kernels_per_model_device(params):
        if placement is None or placement.is_fully_replicated:  # rows split over devices: compiled as they come
            key = key if placement is None else jax.device_put(key, _whole(placement))
            limit, end = monitor.bounds(wait=False) if monitor is not None else (call.total, call.total)
            # Only a queue held below its end admits sequences after a compaction.
            admit_smaller = limit < min(end, call.total)
            host_placed = options.batch_sharding is not None
            _precompile(call, run_params, plan, key, placement, host_placed, admit_smaller=admit_smaller,
                        partial=partial)  # fmt: skip
        out, segments = _decode_all(call, plan, run_params, key, monitor, options, placement, partial)
    batch = _rollout_batch(call, out, segments)
    return batch if partial is None else (batch, out.paused)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One `generate` call's checked inputs, as its programs take them."""

    ids_np: np.ndarray  # int32 [B, prompt_slots], left-padded to the prompt bucket
    mask_np: np.ndarray  # int32 [B, prompt_slots]
    limits: np.ndarray  # int32 [N] each sequence's token limit
    streams_N: np.ndarray  # uint32 [N] each sequence's PRNG stream
    group_size: int
    max_new: int  # sampling.max_new_tokens: the output's response columns
    stop_V: np.ndarray  # bool [V] the stop ids
    pad_id: int
    static: programs.Static

    @property
    def total(self) -> int:
        return self.ids_np.shape[0] * self.group_size

    @property
    def prompt_slots(self) -> int:
        return self.ids_np.shape[1]

    @functools.cached_property
    def prompt_of_seq(self) -> np.ndarray:
        """int32 [N] the prompt (row of ids_np) each sequence samples from."""
        return np.arange(self.total, dtype=np.int32) // self.group_size


def _prepare_call(
    config: ModelConfig, prompt_ids, prompt_mask, sampling: SamplingConfig, group_size: int, lora_scale: float,
    max_new_tokens_per_seq, streams, options: RolloutOptions,
) -> _Call:  # fmt: skip
    """`generate`'s arguments checked (ValueError naming the bad one) and made its programs' inputs:
    the prompts cut or padded to their bucket, the stop ids as a mask, the programs' static settings."""
    ids_np = np.asarray(prompt_ids)
    mask_np = np.asarray(prompt_mask)
    lengths = _check_prompts(config, ids_np, mask_np, sampling.max_new_tokens)
    total = ids_np.shape[0] * group_size
    limits = _check_limits(max_new_tokens_per_seq, total, sampling.max_new_tokens)
    streams_N = _check_streams(streams, total)
    attention = decode_attention_backend(options.decode_attention)
    p_b = scheduler.prompt_bucket(max(int(lengths.max()), options.min_prompt_len))
    ids_np, mask_np = _to_prompt_bucket(ids_np.astype(np.int32), mask_np.astype(np.int32), p_b)
    stop_V, pad_id = _stop_and_pad(config, sampling)
    static = programs.Static(
        config=config,
        sampling=SamplingConfig(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, greedy=sampling.greedy
        ),
        options=ForwardOptions(
            lora_scale=float(lora_scale),
            backend=options.backend,
            decode_attention=attention,
            decode_norm_parts=options.norm_parts,
        ),
        new_slots=scheduler.new_tokens_bucket(sampling.max_new_tokens),
        cache_dtype=jnp.dtype(options.cache_dtype).name,
    )
    return _Call(ids_np, mask_np, limits, streams_N, group_size, sampling.max_new_tokens, stop_V, pad_id, static)


def _to_prompt_bucket(ids_np: np.ndarray, mask_np: np.ndarray, p_b: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts made p_b columns wide: leading columns that are padding in every row
    dropped, or padding columns added on the left."""
    width = ids_np.shape[1]
    if width >= p_b:
        return ids_np[:, width - p_b :], mask_np[:, width - p_b :]
    pad = ((0, 0), (p_b - width, 0))
    return np.pad(ids_np, pad), np.pad(mask_np, pad)


def _stop_and_pad(config: ModelConfig, sampling: SamplingConfig) -> tuple[np.ndarray, int]:
    """(bool [V] mask of the stop ids, the pad id) of the sampling settings; ids outside the vocabulary
    are a ValueError."""
    stop_ids = () if sampling.ignore_eos else (config.eos_token_id if sampling.eos_ids is None else sampling.eos_ids)
    pad_id = sampling.pad_id if sampling.pad_id is not None else (config.pad_token_id or 0)
    bad_ids = [i for i in (*stop_ids, pad_id) if not 0 <= i < config.vocab_size]
    if bad_ids:
        raise ValueError(f"stop/pad ids {bad_ids} are outside [0, vocab_size={config.vocab_size})")
    stop_V = np.zeros((config.vocab_size,), bool)
    stop_V[list(stop_ids)] = True
    return stop_V, pad_id


def _decode_all(
    call: _Call, plan: RolloutPlan, run_params, key: jax.Array, monitor: RolloutMonitor | None, options: RolloutOptions,
    placement: jax.sharding.Sharding | None, partial: Partial | None = None,
) -> tuple[_Outputs, _Segments]:  # fmt: skip
    """Runs the scheduler over the device programs until no sequence is left to decode: admit into
    free rows, decode, harvest the rows that stopped (telling the monitor), compact the tail. The
    outputs and each segment's decode steps and seconds (`_Segments`). placement: of the cache and rows (`_committed_placement`).
    partial: sequences under way (`generate`); the outputs' `paused` then holds those paused."""
    batch_sharding, total = options.batch_sharding, call.total
    put = (lambda a: a) if batch_sharding is None else (lambda a: jax.device_put(a, batch_sharding))
    out = _Outputs(total, call.max_new, call.pad_id)
    skip, resume_of = out.take_partial(partial, monitor)
    sched = scheduler.Scheduler(total, rows=plan.rows, max_batch=plan.max_batch, smaller=plan.smaller, skip=skip)
    cache, rows = programs.new_rows(call.static, plan.rows, call.prompt_slots, call.pad_id, placement)
    max_steps = np.int32(MONITOR_STEPS if monitor is not None else call.static.new_slots)
    segments, clock = _Segments([], [], []), time.perf_counter()
    while True:
        if monitor is not None:
            dropped, dropped_seqs = sched.set_bounds(*monitor.bounds(wait=sched.idle))
            if dropped.size:
                out.decoded[dropped_seqs] = np.asarray(jax.device_get(rows.t))[dropped]
                rows = programs.stop(rows, put(np.isin(np.arange(sched.rows), dropped)))
            if partial is not None and monitor.done():
                out.pause(partial, resume_of, sched, jax.device_get((rows.t, rows.tokens, rows.logp)))
                break
        if sched.idle:
            break
        cache, rows = _fill_free_rows(call, plan, run_params, cache, rows, sched, partial, resume_of, key, options, put)
        exit_live = np.int32(sched.exit_live())
        decoding = time.perf_counter()
        # On a GPU the call itself holds this thread until XLA's while loop ends (each iteration's
        # condition is read on the host), so the segment is timed from its dispatch to its live rows.
        cache, rows, steps = programs.decode(
            call.static, run_params, cache, rows, key, call.stop_V, exit_live, max_steps
        )
        live = np.asarray(rows.live)
        segments.steps.append(int(steps))
        segments.rows.append(sched.rows)
        segments.seconds.append((decoding - clock, time.perf_counter() - decoding))
        clock = time.perf_counter()
        done_rows, done_seqs = sched.retire(live)
        if done_rows.size:
            out.harvest(jax.device_get((rows.t, rows.stopped, rows.tokens, rows.logp)), done_rows, done_seqs)
            if monitor is not None:
                monitor.finished(done_seqs, out.tokens[done_seqs], out.lengths[done_seqs])
        keep = sched.compaction()
        if keep is not None:
            valid = sched.row_seq >= 0
            cache, rows = programs.compact(call.static, cache, rows, put(keep.astype(np.int32)), put(valid))
    del cache, rows
    if segments.seconds:  # the last harvest, compaction or pause: host work after the last segment
        host, device = segments.seconds[-1]
        segments.seconds[-1] = (host + time.perf_counter() - clock, device)
    return out, segments


def _fill_free_rows(
    call: _Call, plan: RolloutPlan, run_params, cache, rows, sched, partial, resume_of, key, options, put
):
    """(cache, rows) with the scheduler's next sequences in its free rows: carried sequences (`partial`,
    first in the queue) resumed, the others admitted (their prompts prefilled), admit_rows a program."""
    seqs, dest = sched.admissions()
    if resume_of is not None:  # carried sequences come first in the queue: resumed, not prefilled anew
        again = resume_of[seqs] >= 0
        cache, rows = _resume_rows(call, plan, run_params, cache, rows, partial, resume_of[seqs[again]],
                                   dest[again], sched.rows, put)  # fmt: skip
        seqs, dest = seqs[~again], dest[~again]
    for i in range(0, len(seqs), plan.admit_rows):
        args = _admission(
            call.ids_np, call.mask_np, call.prompt_of_seq, call.limits, seqs[i : i + plan.admit_rows],
            dest[i : i + plan.admit_rows], rows=sched.rows, admit_rows=plan.admit_rows,
            admit_prompts=plan.admit_prompts, share=options.share_prefill, streams=call.streams_N,
        )  # fmt: skip
        cache, rows = programs.admit(
            call.static, run_params, cache, rows, *map(put, args), key, call.stop_V, np.int32(call.pad_id)
        )
    return cache, rows


class _Segments(NamedTuple):
    """The decode loop's segments: the steps each ran, its bucket's rows, and its (host, device) seconds."""

    steps: list[int]
    rows: list[int]
    seconds: list[tuple[float, float]]


def _rollout_batch(call: _Call, out: _Outputs, segments: _Segments) -> RolloutBatch:
    """The call's `RolloutBatch`: each sequence's prompt beside its harvested response."""
    prompt_index = call.prompt_of_seq
    response_mask = (np.arange(call.max_new)[None, :] < out.lengths[:, None]).astype(np.int32)
    # device_put, not jnp.asarray: that compiles a program for each new shape, and a call's row count
    # changes from step to step.
    return RolloutBatch(
        prompt_ids=jax.device_put(call.ids_np[prompt_index]),
        prompt_mask=jax.device_put(call.mask_np[prompt_index]),
        tokens=jax.device_put(out.tokens),
        logprobs=jax.device_put(out.logprobs),
        response_mask=jax.device_put(response_mask),
        lengths=jax.device_put(out.lengths),
        decoded=jax.device_put(out.decoded),
        truncated=jax.device_put(~out.stopped),
        prompt_index=jax.device_put(prompt_index),
        steps=jax.device_put(np.asarray(segments.steps, np.int32) + 1),
        segment_s=jax.device_put(np.asarray(segments.seconds, np.float32).reshape(-1, 2)),
        segment_rows=jax.device_put(np.asarray(segments.rows, np.int32)),
        group_size=call.group_size,
    )


def _committed_placement(params) -> jax.sharding.Sharding | None:
    """Where a call keeps its own device arrays (cache, rows, key) when the params are committed
    to one device (a data shard's view of them, `rollout.data_parallel`): jit commits its outputs
    there too, so the arrays are put there from the start and the programs precompiled with that
    sharding; otherwise each program would compile again in the decode loop. None: the params
    are uncommitted or span several devices (jit places the arrays)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array) and leaf.committed:
            return _whole(leaf.sharding) if len(leaf.sharding.device_set) == 1 else None
    return None


def _whole(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """`sharding`'s devices, every array replicated over them (a NamedSharding's mesh with P())."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _precompile(
    call: _Call, run_params, plan: RolloutPlan, key, placement, host_inputs_placed: bool, *, admit_smaller: bool,
    partial: Partial | None = None,
) -> None:  # fmt: skip
    """Compiles the programs a call will run, in parallel threads (XLA releases the GIL while it
    compiles; tracing stays serial, each program compiling while the next is traced): `jax.jit`'s
    cache then serves the calls. Programs compiled before (an earlier call, or the persistent
    compilation cache) come back at once. placement: the sharding of the call's cache, rows and
    key, as the calls will pass them. admit_smaller: admissions into the compacted buckets too (a
    monitor may let sequences in after a compaction). partial: given (a partial rollout's call, even
    one carrying nothing), the programs that re-admit carried sequences (`programs.resume`, into the
    first bucket, where they go first) for every span, those of later calls too (`_resume_specs`)."""
    jobs = _program_specs(call, run_params, plan, key, placement, host_inputs_placed, admit_smaller)
    if partial is not None:
        jobs += _resume_specs(call, run_params, plan, placement, host_inputs_placed)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), COMPILE_THREADS)) as pool:
        # Tracing and lowering hold the GIL (serial, here); each program compiles, or loads from
        # the persistent cache, as soon as it is lowered, while the next ones are traced.
        compiled = [pool.submit(fn.trace(*args).lower().compile) for fn, args in jobs]
        for future in compiled:
            future.result()


def _program_specs(
    call: _Call, run_params, plan: RolloutPlan, key, placement, host_inputs_placed, admit_smaller
) -> list:
    """(program, argument specs) of each program a call runs: the admission (into every bucket
    with admit_smaller, else the first), the decode of every row bucket, the compactions."""
    static, prompt_slots = call.static, call.prompt_slots
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    host = placement if host_inputs_placed else None
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=host)  # noqa: E731
    key_spec = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_whole(placement) if placement else None)
    stop_spec = jax.ShapeDtypeStruct(call.stop_V.shape, call.stop_V.dtype)
    buckets = {b: _state_specs(call, b, placement) for b in plan.buckets}
    k, bp = plan.admit_rows, plan.admit_prompts
    admission = (
        spec((bp, prompt_slots), jnp.int32), spec((bp, prompt_slots), jnp.int32), spec((k,), jnp.int32),
        spec((k,), jnp.int32), spec((k,), jnp.uint32), spec((k,), jnp.int32), key_spec, stop_spec, scalar,
    )  # fmt: skip
    admit_buckets = plan.buckets if admit_smaller else (plan.rows,)
    jobs = [(programs.admit, (static, run_params, *buckets[b], *admission)) for b in admit_buckets]
    jobs += [
        (programs.decode, (static, run_params, *buckets[b], key_spec, stop_spec, scalar, scalar)) for b in plan.buckets
    ]
    for big, small in zip(plan.buckets, plan.buckets[1:]):
        jobs.append((programs.compact, (static, *buckets[big], spec((small,), jnp.int32), spec((small,), bool))))
    return jobs


def _state_specs(call: _Call, rows: int, placement) -> tuple:
    """The (cache, rows) specs of a bucket of `rows` rows, placed as the calls pass them."""
    cache_sharding = programs.cache_sharding(call.static, placement)
    in_cache = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cache_sharding)  # noqa: E731
    placed = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement)  # noqa: E731
    cache, state = jax.eval_shape(lambda: programs._empty(call.static, rows, call.prompt_slots, 0))
    return jax.tree.map(in_cache, cache), jax.tree.map(placed, state)


def _resume_specs(call: _Call, run_params, plan: RolloutPlan, placement, host_inputs_placed) -> list:
    """(programs.resume, argument specs) of each program `_resume_rows` may run into the first bucket:
    one per span (`scheduler.resume_spans`), whatever this call carries: compiled only as spans first
    occurred, each new span's compile (~8 s for the 1.5B on an H200) ran alone inside a later step's rollout."""
    static, m = call.static, call.static.new_slots
    host = placement if host_inputs_placed else None
    spec = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=host)  # noqa: E731
    state = _state_specs(call, plan.rows, placement)
    jobs = []
    for span in scheduler.resume_spans(m):
        k = _resume_rows_per_call(call, plan, span)
        resumption = (
            spec(k, call.prompt_slots), spec(k, call.prompt_slots), spec(k, span), spec(k, m),
            spec(k, m, dtype=jnp.float32), spec(k), spec(k), spec(k, dtype=jnp.uint32), spec(k),
        )  # fmt: skip
        jobs.append((programs.resume, (static, run_params, *state, *resumption)))
    return jobs


def _admission(ids_np, mask_np, prompt_of_seq, limits, seqs, dest, *, rows, admit_rows, admit_prompts, share, streams):
    """The host arrays of one `programs.admit` call: (ids, mask, src, dest, seq, limit), padded
    to admit_prompts prompts (filler: one real pad token) and admit_rows sequences (dest = rows:
    dropped); seq is each sequence's PRNG stream (`streams`)."""
    p = ids_np.shape[1]
    prompts = np.unique(prompt_of_seq[seqs]) if share else prompt_of_seq[seqs]
    ids = np.zeros((admit_prompts, p), np.int32)
    mask = np.zeros((admit_prompts, p), np.int32)
    mask[:, -1] = 1  # fillers: one real token, so no row is fully masked
    ids[: len(prompts)] = ids_np[prompts]
    mask[: len(prompts)] = mask_np[prompts]
    count = len(seqs)
    src = np.zeros((admit_rows,), np.int32)
    src[:count] = np.searchsorted(prompts, prompt_of_seq[seqs]) if share else np.arange(count)
    dest_k = np.full((admit_rows,), rows, np.int32)
    dest_k[:count] = dest
    seq_k = np.zeros((admit_rows,), np.uint32)
    seq_k[:count] = streams[seqs]
    limit_k = np.ones((admit_rows,), np.int32)
    limit_k[:count] = limits[seqs]
    return ids, mask, src, dest_k, seq_k, limit_k


def _resume_rows(call: _Call, plan: RolloutPlan, run_params, cache, rows, partial: Partial, carried, dest, bucket, put):
    """(cache, rows) with the `partial` sequences `carried` (indices into it) resumed into rows `dest`,
    the longest first, in programs of a few rows each (`_resume_chunks`)."""
    for chunk, span, k in _resume_chunks(call, plan, partial.lengths_K[carried]):
        args = _resumption(call, partial, carried[chunk], dest[chunk], rows=bucket, admit_rows=k, span=span)
        cache, rows = programs.resume(call.static, run_params, cache, rows, *map(put, args))
    return cache, rows


def _resume_chunks(call: _Call, plan: RolloutPlan, lengths_K: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
    """How sequences of these token counts are resumed: [(their indices, span, rows per program)], the
    longest first, so that each program's span (`scheduler.resume_span` of its longest) fits its rows."""
    order = np.argsort(-np.asarray(lengths_K), kind="stable")
    chunks, i = [], 0
    while i < len(order):
        span = _resume_span(call, lengths_K[order[i]])
        k = _resume_rows_per_call(call, plan, span)
        chunks.append((order[i : i + k], span, k))
        i += k
    return chunks


def _resume_span(call: _Call, length: int) -> int:
    """The response slots a resumed sequence of `length` tokens is re-prefilled over: its first
    length - 1 tokens (the last one is fed by the next decode step), in `scheduler.resume_span`'s buckets."""
    return scheduler.resume_span(int(length) - 1, call.static.new_slots)


def _resume_rows_per_call(call: _Call, plan: RolloutPlan, span: int) -> int:
    """A resumed row's forward spans its P + span slots (attention's scores grow with their square, which
    the memory plan does not count): as many rows per program as an admission prefills prompt tokens."""
    slots = call.prompt_slots + span
    return max(1, min(plan.admit_rows, plan.admit_prompts * call.prompt_slots // slots))


def _resumption(call: _Call, partial: Partial, carried, dest, *, rows: int, admit_rows: int, span: int):
    """The host arrays of one `programs.resume` call: (ids, mask, fed, tokens, logp, t, dest, seq, limit)
    of the `partial` sequences `carried` (indices into it) going to rows `dest`, padded to
    admit_rows (fillers: one real prompt token, dest = rows: dropped); fed: the tokens' first span
    columns, the ones the forward re-prefills."""
    seqs, count, m = partial.seqs_K[carried], len(carried), call.static.new_slots
    prompts = seqs // call.group_size
    ids = np.zeros((admit_rows, call.prompt_slots), np.int32)
    mask = np.zeros((admit_rows, call.prompt_slots), np.int32)
    mask[:, -1] = 1
    ids[:count], mask[:count] = call.ids_np[prompts], call.mask_np[prompts]
    tokens = np.full((admit_rows, m), call.pad_id, np.int32)
    logp = np.zeros((admit_rows, m), np.float32)
    tokens[:count, : call.max_new] = partial.tokens_KxM[carried]
    logp[:count, : call.max_new] = partial.logprobs_KxM[carried]
    t, limit = np.ones((admit_rows,), np.int32), np.ones((admit_rows,), np.int32)
    t[:count], limit[:count] = partial.lengths_K[carried], call.limits[seqs]
    dest_k = np.full((admit_rows,), rows, np.int32)
    dest_k[:count] = dest
    seq_k = np.zeros((admit_rows,), np.uint32)
    seq_k[:count] = call.streams_N[seqs]
    return ids, mask, np.ascontiguousarray(tokens[:, :span]), tokens, logp, t, dest_k, seq_k, limit


class _Outputs:
    """The [N, M] outputs, filled in as sequences retire."""

    def __init__(self, num_seqs: int, max_new: int, pad_id: int):
        self.tokens = np.full((num_seqs, max_new), pad_id, np.int32)
        self.logprobs = np.zeros((num_seqs, max_new), np.float32)
        self.lengths = np.zeros((num_seqs,), np.int32)
        self.decoded = np.zeros((num_seqs,), np.int32)  # lengths, and the dropped rows' partial counts
        self.stopped = np.zeros((num_seqs,), bool)
        self.paused: Partial | None = None

    def take_partial(self, partial: Partial | None, monitor) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The finished sequences of `partial` filled in (and reported to the monitor); (bool [N]
        those the queue skips, int [N] each resumed sequence's index in `partial`, else -1)."""
        if partial is None:
            return None, None
        self.paused = Partial.empty(self.tokens.shape[1])
        done, seqs = np.asarray(partial.finished_K, bool), np.asarray(partial.seqs_K)
        finished = seqs[done]
        self.tokens[finished], self.logprobs[finished] = partial.tokens_KxM[done], partial.logprobs_KxM[done]
        self.lengths[finished] = self.decoded[finished] = partial.lengths_K[done]
        self.stopped[finished] = partial.stopped_K[done]
        if monitor is not None and finished.size:
            monitor.finished(finished, self.tokens[finished], self.lengths[finished])
        skip = np.zeros((len(self.lengths),), bool)
        skip[finished] = True
        resume_of = np.full((len(self.lengths),), -1, np.int64)
        resume_of[seqs[~done]] = np.flatnonzero(~done)
        return skip, resume_of

    def pause(self, partial: Partial, resume_of: np.ndarray, sched: scheduler.Scheduler, state) -> None:
        """`paused`: the sequences decoding in rows (state: their (t, tokens, logp)) and the resumed
        ones not admitted yet, as they stand."""
        t, tokens, logp = (np.asarray(a) for a in state)
        m = self.tokens.shape[1]
        rows = np.flatnonzero(sched.row_seq >= 0)
        waiting = np.flatnonzero((resume_of >= 0) & (np.arange(len(resume_of)) >= sched.next_seq))
        carried = resume_of[waiting]
        self.decoded[sched.row_seq[rows]], self.decoded[waiting] = t[rows], partial.lengths_K[carried]
        self.paused = Partial(
            seqs_K=np.concatenate([sched.row_seq[rows], waiting]),
            tokens_KxM=np.concatenate([tokens[rows, :m], partial.tokens_KxM[carried]]).astype(np.int32),
            logprobs_KxM=np.concatenate([logp[rows, :m], partial.logprobs_KxM[carried]]).astype(np.float32),
            lengths_K=np.concatenate([t[rows], partial.lengths_K[carried]]).astype(np.int32),
            finished_K=np.zeros((len(rows) + len(waiting),), bool),
            stopped_K=np.zeros((len(rows) + len(waiting),), bool),
        )

    def harvest(self, state, rows: np.ndarray, seqs: np.ndarray) -> None:
        t, stopped, tokens, logp = state
        m = self.tokens.shape[1]
        self.lengths[seqs] = t[rows]
        self.decoded[seqs] = t[rows]
        self.stopped[seqs] = stopped[rows]
        self.tokens[seqs] = tokens[rows, :m]
        self.logprobs[seqs] = logp[rows, :m]
