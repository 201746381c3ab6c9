"""The jitted GRPO/DAPO train step: LoRA (and trained norm scale) gradients, micro-batch accumulation, non-finite skips.

Batch format: a packed batch (`rl.packing.pack_batch` of the rollout's padded one): the B
sequences' real tokens back to back in R rows of L slots (input_ids, segment_ids [R, L]), and per
sequence, token-aligned and left-aligned [B, L]: token_index (each token's packed slot),
response_mask, old_logp; advantages [B]. The forward runs on the packed rows (attention within each
segment); its log-probs are gathered onto the per-sequence next-token grid [B, L-1] (logp of token
t + 1 sits at token t's slot; `to_next_token_grid` maps the per-sequence arrays onto it), where the
loss is exactly the padded batch's. R is a multiple of the micro-batch; the micro-batches run one
compiled micro-step each (a Python loop: any R, one program), then one compiled update.

Only `TrainState.lora` (and, when the norm scales train too, `TrainState.norms`) and the
optimizer state change; the frozen {base, norms} are an input, never donated nor copied.
Several optimizer updates per rollout batch (PPO epochs, or
mini-batches as TRL's steps_per_generation) are the caller's loop: call the step once per
update with the same rollout old_logp; with exactly one update per
rollout, LossConfig(old_logp_source="current") reproduces TRL's on-policy ratio of 1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from qerl_jax import linear
from qerl_jax.lora import check_lora, check_trained_norms, with_lora
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.rl.logprobs import to_next_token_grid, token_logprobs
from qerl_jax.rl.losses import LossConfig, loss_normalizer, policy_loss
from qerl_jax.rl.packing import PACKED_KEYS

BATCH_KEYS = PACKED_KEYS


@struct.dataclass
class TrainState:
    """Everything the train step updates (a pytree; donated to the step)."""

    lora: Any
    opt_state: Any
    step: jax.Array  # int32: number of optimizer updates applied
    consecutive_skips: jax.Array  # int32: non-finite steps in a row (reset by a good step)
    total_skips: jax.Array  # int32
    norms: Any = None  # trained RMSNorm scales {"layers": {name: [L, D] float32}} (`lora.TRAINED_NORMS`), or None


def optimizer_params(lora: Any, norms: Any) -> Any:
    """The pytree optax updates: the LoRA alone, or {"lora", "norms"} when the norm scales train too."""
    return lora if norms is None else {"lora": lora, "norms": norms}


def init_train_state(
    lora: dict[str, Any], optimizer: optax.GradientTransformation, norms: dict[str, Any] | None = None
) -> TrainState:
    """A fresh state for `lora` (float32 recommended) and the trained norms (`lora.init_trained_norms`; None: frozen).

    Every leaf is a fresh copy: the step donates the state, so it must not alias the caller's
    arrays (nor one buffer twice).
    """
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = TrainState(
        lora=lora,
        opt_state=optimizer.init(optimizer_params(lora, norms)),
        step=zero(),
        consecutive_skips=zero(),
        total_skips=zero(),
        norms=norms,
    )
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


class NonFiniteError(RuntimeError):
    """Raised by `check_nonfinite` when too many steps in a row had NaN/inf loss or gradients."""


def check_nonfinite(state: TrainState, max_consecutive: int) -> None:
    """Raises NonFiniteError when the last `max_consecutive` steps were all skipped (host sync)."""
    n = int(state.consecutive_skips)
    if n >= max_consecutive:
        raise NonFiniteError(
            f"{n} consecutive train steps had a non-finite loss or gradient (NaN/inf) and were skipped "
            f"(limit {max_consecutive}; {int(state.total_skips)} skipped in total, {int(state.step)} updates applied). "
            "Stopping: check the rollout batch (old_logp, advantages, rewards), the learning rate and the LoRA weights."
        )


def validate_batch(batch: dict[str, Any], micro_batch_size: int | None, ref_logp=None) -> tuple[int, int, int]:
    """Checks keys, shapes and the response alignment of a packed batch; returns (R, L, B)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"train batch is missing {missing}; expected keys {BATCH_KEYS} (rl.packing.pack_batch)")
    ids = batch["input_ids"]
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"batch['input_ids'] must be [R, L] with L >= 2; got shape {tuple(ids.shape)}")
    r, length = ids.shape
    if tuple(batch["segment_ids"].shape) != (r, length):
        raise ValueError(f"batch['segment_ids'] has shape {tuple(batch['segment_ids'].shape)}; expected {(r, length)}")
    b = batch["advantages"].shape[0] if batch["advantages"].ndim == 1 else -1
    for k in ("token_index", "response_mask", "old_logp"):
        if tuple(batch[k].shape) != (b, length):
            raise ValueError(
                f"batch[{k!r}] has shape {tuple(batch[k].shape)}; expected (B, L) = {(b, length)} "
                "(B from batch['advantages'] [B], L from batch['input_ids'] [R, L])"
            )
    if ref_logp is not None and tuple(ref_logp.shape) != (b, length):
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}; expected {(b, length)} (like old_logp)")
    if micro_batch_size is not None and r % micro_batch_size:
        raise ValueError(f"packed rows {r} are not a multiple of micro_batch_size={micro_batch_size}")
    if not all(_fetchable(batch[k]) for k in ("response_mask", "token_index")):
        return r, length, b  # a multi-process run's global arrays: its host batch was built valid (rl.packing)
    resp = np.asarray(batch["response_mask"]).astype(bool)
    if resp[:, 0].any():
        raise ValueError("batch['response_mask'][:, 0] is set: position 0 has no log-prob (it has no prefix)")
    index = np.asarray(batch["token_index"])
    if (resp & (index < 0)).any():
        raise ValueError("batch['response_mask'] marks tokens past their sequence's end (token_index -1)")
    if index.max(initial=-1) >= r * length:
        raise ValueError(f"batch['token_index'] points past the {r} x {length} packed slots")
    return r, length, b


def _fetchable(x) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def train_arrays(batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The batch's BATCH_KEYS as the jitted step takes them: int32 input_ids / segment_ids / token_index,
    float32 response_mask / old_logp / advantages."""
    dtypes = {"input_ids": jnp.int32, "segment_ids": jnp.int32, "token_index": jnp.int32}
    return {k: jnp.asarray(batch[k], dtypes.get(k, jnp.float32)) for k in BATCH_KEYS}


def _micro_rows(x: jax.Array, rows: slice) -> jax.Array:
    """Rows of a packed [R, L] array with its sharding kept: a data-parallel batch's micro-batch is
    split over the devices (a plain slice would leave it on the devices holding those rows). One
    program per (micro-batch size, sharding), the first row an argument; it also slices a
    multi-process run's global arrays."""
    return _row_slicer(rows.stop - rows.start, x.sharding)(x, jnp.int32(rows.start))


@functools.lru_cache(maxsize=16)
def _row_slicer(size: int, sharding: jax.sharding.Sharding):
    keep = sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
    return jax.jit(lambda x, first: jax.lax.dynamic_slice_in_dim(x, first, size), out_shardings=keep)


def _to_sequences(x_RxLm1: jax.Array, source_BxLm1: jax.Array, first_row) -> tuple[jax.Array, jax.Array]:
    """Packed next-token values of rows [first_row, first_row + R) -> the sequences' grid (0 elsewhere),
    and where the grid took a value from these rows."""
    r, lm1 = x_RxLm1.shape
    flat = jnp.pad(x_RxLm1, ((0, 0), (0, 1))).reshape(-1)
    local = source_BxLm1 - first_row * (lm1 + 1)
    inside = (source_BxLm1 >= 0) & (local >= 0) & (local < flat.shape[0])
    return jnp.where(inside, jnp.take(flat, jnp.clip(local, 0, flat.shape[0] - 1)), 0.0), inside


def _grid_arrays(batch: dict[str, jax.Array], ref_logp):
    """(source slots, response mask, old log-probs, advantages, reference log-probs or None) on the
    next-token grid [B, L-1]."""
    # Token t + 1's log-prob is computed at token t's slot: the source of grid column t is token t's.
    source = batch["token_index"][:, :-1]
    source = jnp.where(batch["token_index"][:, 1:] >= 0, source, -1)
    resp = to_next_token_grid(batch["response_mask"]).astype(jnp.float32)
    old = to_next_token_grid(batch["old_logp"]).astype(jnp.float32)
    ref = None if ref_logp is None else to_next_token_grid(ref_logp).astype(jnp.float32)
    return source, resp, old, batch["advantages"].astype(jnp.float32), ref


def _mesh_of(tree) -> jax.sharding.Mesh | None:
    """The mesh of `tree`'s first array laid out over several devices; None on one device."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, jax.sharding.NamedSharding) and len(s.device_set) > 1:
            return s.mesh
    return None


def _canonical(sharding: Any, mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """A NamedSharding on `mesh` with its spec's trailing unsharded axes dropped; anything else replicated."""
    spec = list(sharding.spec) if isinstance(sharding, jax.sharding.NamedSharding) else []
    while spec and spec[-1] is None:
        spec.pop()
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


# A program's layout of a pytree it takes and returns: (treedef, its leaves' shardings), or None on one device.
Layout = tuple[Any, tuple[jax.sharding.NamedSharding, ...]] | None


def _layout_of(tree) -> Layout:
    """`tree`'s layout on its mesh, each leaf's sharding canonical (`_canonical`); None on one device."""
    mesh = _mesh_of(tree)
    if mesh is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_canonical(getattr(x, "sharding", None), mesh) for x in leaves)


def _acc_layout(trainable, per_seq: dict[str, Any], acc) -> Layout:
    """The accumulators' layout: the gradients as the trainable arrays, the [B, L-1] grids as the batch's."""
    mesh = _mesh_of(trainable) or _mesh_of(per_seq)
    if mesh is None:
        return None
    grads = [_canonical(getattr(x, "sharding", None), mesh) for x in jax.tree.leaves(trainable)]
    leaves, treedef = jax.tree.flatten(acc)
    grid = _canonical(getattr(per_seq["response_mask"], "sharding", None), mesh)
    return treedef, (*grads, *[grid] * (len(leaves) - len(grads)))


class _ByLayout:
    """A jitted function called with its output's layout as the last argument (`Layout`): one `jax.jit` per
    layout, whose out_shardings are that layout (None: XLA's choice), so the output comes back exactly as
    the next call takes it. `out_shardings(layout)` gives the jit's out_shardings; `lower` as jax.jit's."""

    def __init__(self, fn: Callable, out_shardings: Callable[[Layout], Any], **jit_kwargs):
        self._fn, self._out_shardings, self._jit_kwargs = fn, out_shardings, jit_kwargs
        self._jits: dict[Layout, Any] = {None: jax.jit(fn, **jit_kwargs)}  # one device's

    def _jit(self, layout: Layout):
        if layout not in self._jits:
            self._jits[layout] = jax.jit(self._fn, **self._jit_kwargs, out_shardings=self._out_shardings(layout))
        return self._jits[layout]

    def __call__(self, *args):
        return self._jit(args[-1])(*args[:-1])

    def lower(self, *args):
        return self._jit(args[-1]).lower(*args[:-1])

    def _cache_size(self) -> int:
        return sum(j._cache_size() for j in self._jits.values())


def _tree(layout: Layout):
    return jax.tree.unflatten(layout[0], layout[1])


def _replicated(layout: Layout) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(layout[1][0].mesh, jax.sharding.PartitionSpec())


def _placed_as(tree, layout: Layout):
    """`tree`'s arrays resharded to `layout` where they are not laid out so (one program, every process's
    shards); unchanged without a layout."""
    if layout is None or all(getattr(x, "sharding", None) == s for x, s in zip(jax.tree.leaves(tree), layout[1])):
        return tree
    return _resharder(layout)(tree)


@functools.lru_cache(maxsize=16)
def _resharder(layout: Layout):
    return jax.jit(lambda t: t, out_shardings=_tree(layout))


class _Inputs(NamedTuple):
    """A step's inputs as its two programs take them: the state and the zero accumulators placed in their
    layouts (`_placed_as`)."""

    state: TrainState
    frozen: dict[str, Any]  # {"base", "norms"}
    arrays: dict[str, Any]  # `train_arrays` of the batch
    per_seq: dict[str, Any]  # arrays but the packed rows' ids and segments
    ref: jax.Array | None  # reference log-probs given to the step
    acc: tuple  # zero (gradients, log-probs, entropies, reference log-probs or None)
    acc_layout: Layout
    state_layout: Layout


class TrainStep:
    """The jitted train step: `step(state, frozen, batch, ref_logp=None) -> (state, metrics)`.

    frozen: {"base", "norms"} (clean norms; any "lora" key is ignored). batch: see module doc.
    ref_logp: optional reference log-probs [B, L], laid out like old_logp; when LossConfig.beta > 0
      and it is None, they are computed in the step from the same base without LoRA.
    micro_batch_size: the packed rows are processed micro_batch_size at a time, gradients summed
      (each micro-loss is normalised by the full batch's token/sequence count, so the update
      equals the full-batch one); None: all rows at once.
    logprob_chunk: LM-head chunk size for `token_logprobs`; remat: per-layer checkpointing, one of
    `models.qwen2.REMAT_MODES` or a bool; attention: the full-sequence attention, one of
    `models.qwen2.ATTENTION_MODES` (attention stays within each packed segment either way).
    The update donates `state`. `micro` and `update` are the two jitted programs (`lower_args`
    gives their arguments for a batch, `precompile` compiles them; lower `micro` of tensor-parallel
    params under `linear.kernels_per_model_device`, as the step runs it). A step whose loss or gradient
    is not finite leaves lora/norms/opt_state/step unchanged and increments the skip counters (see
    `check_nonfinite`).
    state.norms (trained RMSNorm scales, or None) train beside the LoRA: the forward uses them in
    place of frozen["norms"]'s per-layer scales (the LoRA-free reference of beta > 0 keeps the frozen ones).
    Metrics: policy_loss's metrics + grad_norm (before clipping, over LoRA and trained norms), skipped,
    consecutive_skips, step (updates applied after this step) and lr (of this update, when lr_schedule is given).
    """

    def __init__(
        self,
        config: ModelConfig,
        loss_cfg: LossConfig,
        optimizer: optax.GradientTransformation,
        *,
        lora_scale: float,
        backend: str = "xla",
        remat: bool | str = True,
        attention: str = "xla",
        micro_batch_size: int | None = None,
        logprob_chunk: int | None = None,
        temperature: float = 1.0,
        lr_schedule: Callable | None = None,
        compiler_options: dict[str, Any] | None = None,
    ):
        self.config, self.loss_cfg, self.optimizer = config, loss_cfg, optimizer
        self.micro_batch_size = micro_batch_size
        self.lr_schedule = lr_schedule
        self._logprobs = functools.partial(
            token_logprobs,
            config,
            lora_scale=lora_scale,
            backend=backend,
            remat=remat,
            attention=attention,
            chunk_size=logprob_chunk,
            temperature=temperature,
        )
        # one micro-batch's gradients; compiler_options: XLA's for its program (`fp8.TRAIN_COMPILER_OPTIONS`)
        # On a mesh both programs take and return the accumulators and the state in one layout (their last
        # argument; `_layout_of`), so a step's later micro-steps and updates reuse the first ones' programs.
        # Fed unplaced zeros and the init state's specs, each compiled twice, and again at the second step.
        self.micro = _ByLayout(self.micro_fn, _tree, donate_argnums=(7,), compiler_options=compiler_options)
        self.update = _ByLayout(  # the optimizer update and the metrics (replicated scalars)
            self.update_fn, lambda layout: (_tree(layout), _replicated(layout)), donate_argnums=(0,)
        )
        self._checked_structures: list[Any] = []

    def logprobs(self, params, ids, seg):
        """(log-probs, entropies) [R, L-1] of packed rows `ids` with segments `seg` under `params`."""
        return self._logprobs(params, ids, None, segment_ids=seg)

    def micro_fn(self, trainable, frozen, ids, seg, first_row, batch, ref_logp, acc):
        """One micro-batch of packed rows: its loss share's gradient of trainable = (lora, norms or None),
        added to acc (the traced function of `micro`)."""
        grad_acc, logp_acc, ent_acc, ref_acc = acc
        source, resp, old, adv, ref = _grid_arrays(batch, ref_logp)
        normalizer = loss_normalizer(resp, self.loss_cfg)
        if ref is None and self.loss_cfg.needs_ref:
            ref_rows = jax.lax.stop_gradient(self.logprobs(frozen, ids, seg)[0])  # same base, LoRA off
            ref = _to_sequences(ref_rows, source, first_row)[0]

        def loss_fn(trainable_):
            logp_rows, ent_rows = self.logprobs(with_lora(frozen, *trainable_), ids, seg)
            logp, inside = _to_sequences(logp_rows, source, first_row)
            with jax.named_scope("loss"):
                # Only this micro-batch's sequences count; the normalizer is the full batch's.
                loss, _ = policy_loss(logp, old, adv, resp * inside, self.loss_cfg, ref_logp=ref, normalizer=normalizer)
            return loss, (logp, _to_sequences(ent_rows, source, first_row)[0], inside)

        (_, (logp, ent, inside)), g = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        grad_acc = jax.tree.map(lambda a, gi: a + gi.astype(a.dtype), grad_acc, g)
        logp_acc = jnp.where(inside, jax.lax.stop_gradient(logp), logp_acc)
        ent_acc = jnp.where(inside, ent, ent_acc)
        if ref_acc is not None:
            ref_acc = jnp.where(inside, ref, ref_acc)
        return grad_acc, logp_acc, ent_acc, ref_acc

    def update_fn(self, state: TrainState, batch, ref_logp, acc):
        """The optimizer update from the summed gradients, and the batch's metrics (the traced
        function of `update`)."""
        grads, logp, ent, ref_used = acc
        _, resp, old, adv, ref = _grid_arrays(batch, ref_logp)
        ref_used = ref if ref is not None else ref_used
        normalizer = loss_normalizer(resp, self.loss_cfg)
        loss, metrics = policy_loss(
            logp, old, adv, resp, self.loss_cfg, ref_logp=ref_used, entropy=ent, normalizer=normalizer
        )
        params = optimizer_params(state.lora, state.norms)
        grads = jax.tree.map(lambda gi, p: gi.astype(p.dtype), optimizer_params(*grads), params)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_state = self._applied(state, grads, ok)
        metrics.update(
            grad_norm=grad_norm,
            skipped=(~ok).astype(jnp.float32),
            consecutive_skips=new_state.consecutive_skips,
            step=new_state.step,
        )
        if self.lr_schedule is not None:
            metrics["lr"] = jnp.asarray(self.lr_schedule(state.step), jnp.float32)
        return new_state, metrics

    def _applied(self, state: TrainState, grads, ok: jax.Array) -> TrainState:
        """`state` after the optimizer update of `grads` where `ok`; else unchanged but for the skip counters."""
        params = optimizer_params(state.lora, state.norms)
        with jax.named_scope("optimizer"):
            updates, new_opt = self.optimizer.update(grads, state.opt_state, params)
            new_params = optax.apply_updates(params, updates)
        new_lora, new_norms = (new_params, None) if state.norms is None else (new_params["lora"], new_params["norms"])
        keep = lambda new, old_: jax.tree.map(lambda a, c: jnp.where(ok, a, c), new, old_)  # noqa: E731
        skipped = (~ok).astype(jnp.int32)
        return TrainState(
            lora=keep(new_lora, state.lora),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + (1 - skipped),
            consecutive_skips=jnp.where(ok, 0, state.consecutive_skips + 1),
            total_skips=state.total_skips + skipped,
            norms=keep(new_norms, state.norms),
        )

    def _inputs(self, state: TrainState, frozen: dict[str, Any], batch: dict[str, Any], ref_logp=None):
        """The state and the checked batch as the two programs take them (`_Inputs`)."""
        r, length, b = validate_batch(batch, self.micro_batch_size, ref_logp)
        structure = jax.tree.structure((state.lora, state.norms))
        if structure not in self._checked_structures:
            check_lora(state.lora, self.config)
            if state.norms is not None:
                check_trained_norms(state.norms, self.config)
            self._checked_structures.append(structure)
        state_layout = _layout_of(state)
        state = _placed_as(state, state_layout)
        trainable = (state.lora, state.norms)
        ref = None if ref_logp is None else jnp.asarray(ref_logp, jnp.float32)
        frozen = {"base": frozen["base"], "norms": frozen["norms"]}
        arrays = train_arrays(batch)
        per_seq = {k: v for k, v in arrays.items() if k not in ("input_ids", "segment_ids")}
        grid = lambda: jnp.zeros((b, length - 1), jnp.float32)  # noqa: E731
        acc = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable),
            grid(),
            grid(),
            grid() if ref is None and self.loss_cfg.needs_ref else None,
        )
        acc_layout = _acc_layout(trainable, per_seq, acc)
        return _Inputs(state, frozen, arrays, per_seq, ref, _placed_as(acc, acc_layout), acc_layout, state_layout)

    def __call__(self, state: TrainState, frozen: dict[str, Any], batch: dict[str, Any], ref_logp=None):
        x = self._inputs(state, frozen, batch, ref_logp)
        acc = x.acc
        r = x.arrays["input_ids"].shape[0]
        mb = self.micro_batch_size or r
        with linear.kernels_per_model_device(x.frozen):
            for first in range(0, r, mb):
                rows = slice(first, first + mb)
                acc = self.micro(
                    (x.state.lora, x.state.norms),
                    x.frozen,
                    _micro_rows(x.arrays["input_ids"], rows),
                    _micro_rows(x.arrays["segment_ids"], rows),
                    jnp.int32(first),
                    x.per_seq,
                    x.ref,
                    acc,
                    x.acc_layout,
                )
        return self.update(x.state, x.per_seq, x.ref, acc, x.state_layout)

    def lower_args(self, state: TrainState, frozen: dict[str, Any], batch: dict[str, Any], ref_logp=None):
        """(micro_args, update_args): the first micro-step's and the update's arguments for `batch`,
        e.g. `step.micro.lower(*micro_args)` (compile time, HLO, memory analysis)."""
        x = self._inputs(state, frozen, batch, ref_logp)
        mb = self.micro_batch_size or x.arrays["input_ids"].shape[0]
        ids, seg = (_micro_rows(x.arrays[k], slice(0, mb)) for k in ("input_ids", "segment_ids"))
        trainable = (x.state.lora, x.state.norms)
        micro_args = (trainable, x.frozen, ids, seg, jnp.int32(0), x.per_seq, x.ref, x.acc, x.acc_layout)
        return micro_args, (x.state, x.per_seq, x.ref, x.acc, x.state_layout)

    def precompile(self, state: TrainState, frozen: dict[str, Any], batch: dict[str, Any], ref_logp=None) -> None:
        """Compiles the two programs for batches of `batch`'s shapes (or loads them from the
        persistent cache) without running them; a later call on such a batch compiles nothing.
        Made to run in a thread beside a rollout (XLA compiles without the GIL)."""
        micro_args, update_args = self.lower_args(state, frozen, batch, ref_logp)
        with linear.kernels_per_model_device(frozen):
            self.micro.lower(*micro_args).compile()
        self.update.lower(*update_args).compile()
