"""The jitted GRPO/DAPO train step: LoRA-only gradients, micro-batch accumulation, non-finite skips.

Batch format (produced by the rollout engine), all token-aligned [B, T]:
  input_ids      int32   left-padded prompt, then the response, then right padding
  attention_mask int     1 on real tokens (prompt and response), 0 on padding
  response_mask  float/bool  1 on response tokens that count in the loss (never position 0)
  old_logp       float32 log-prob of the token at position t under the sampling policy (0 elsewhere)
  advantages     float32 [B]
The step maps the token-aligned arrays onto `token_logprobs`' next-token grid [B, T-1] with
`to_next_token_grid` (x[:, 1:]), the one place where the shift happens.

Only `TrainState.lora` and the optimizer state change; the frozen {base, norms} are an input,
never donated nor copied. Several optimizer updates per rollout batch (PPO epochs, or
mini-batches as TRL's steps_per_generation) are the caller's loop: call the step once per
update with the same rollout old_logp (`minibatches` splits a batch); with exactly one update per
rollout, LossConfig(old_logp_source="current") reproduces TRL's on-policy ratio of 1.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from qerl_jax.lora import check_lora, with_lora
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.rl.logprobs import to_next_token_grid, token_logprobs
from qerl_jax.rl.losses import LossConfig, loss_normalizer, policy_loss

BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "old_logp", "advantages")


@struct.dataclass
class TrainState:
    """Everything the train step updates (a pytree; donated to the step)."""

    lora: Any
    opt_state: Any
    step: jax.Array  # int32: number of optimizer updates applied
    consecutive_skips: jax.Array  # int32: non-finite steps in a row (reset by a good step)
    total_skips: jax.Array  # int32


def init_train_state(lora: dict[str, Any], optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state for `lora` (float32 recommended).

    Every leaf is a fresh copy: the step donates the state, so it must not alias the caller's
    arrays (nor one buffer twice).
    """
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = TrainState(
        lora=lora, opt_state=optimizer.init(lora), step=zero(), consecutive_skips=zero(), total_skips=zero()
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


def validate_batch(
    batch: dict[str, Any], micro_batch_size: int | None, ref_logp=None, *, contiguous: bool = False
) -> tuple[int, int]:
    """Checks keys, shapes and the response alignment of a rollout batch; returns (B, T).

    contiguous: also check that each row's real tokens (attention_mask 1) are contiguous, as the
    "flash" attention needs (rollout batches are: left-padded prompt, response, right padding)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"train batch is missing {missing}; expected keys {BATCH_KEYS}")
    ids = batch["input_ids"]
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"batch['input_ids'] must be [B, T] with T >= 2; got shape {tuple(ids.shape)}")
    b, t = ids.shape
    for k in ("attention_mask", "response_mask", "old_logp"):
        if tuple(batch[k].shape) != (b, t):
            raise ValueError(
                f"batch[{k!r}] has shape {tuple(batch[k].shape)}; expected {(b, t)} like batch['input_ids']"
            )
    if tuple(batch["advantages"].shape) != (b,):
        raise ValueError(f"batch['advantages'] has shape {tuple(batch['advantages'].shape)}; expected ({b},)")
    if ref_logp is not None and tuple(ref_logp.shape) != (b, t):
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}; expected {(b, t)} (token-aligned like old_logp)")
    if micro_batch_size is not None and b % micro_batch_size:
        raise ValueError(f"batch size {b} is not a multiple of micro_batch_size={micro_batch_size}")
    resp = np.asarray(batch["response_mask"]).astype(bool)
    if resp[:, 0].any():
        raise ValueError("batch['response_mask'][:, 0] is set: position 0 has no log-prob (it has no prefix)")
    attn = np.asarray(batch["attention_mask"]).astype(bool)
    if (resp & ~attn).any():
        raise ValueError("batch['response_mask'] marks tokens whose attention_mask is 0 (padding)")
    if contiguous:
        run_starts = attn & ~np.pad(attn, ((0, 0), (1, 0)))[:, :-1]  # first token of each run of real tokens
        holes = np.flatnonzero(run_starts.sum(axis=1) > 1)
        if holes.size:
            raise ValueError(
                f"batch['attention_mask'] rows {holes[:5].tolist()} have padding between real tokens; the 'flash' "
                "attention needs each row's real tokens contiguous (left and/or right padding only)"
            )
    return b, t


def train_arrays(batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The batch's BATCH_KEYS as the jitted step takes them: int32 input_ids / attention_mask, float32
    response_mask / old_logp / advantages (`make_train_step(...).jitted` for lowering)."""
    dtypes = {"input_ids": jnp.int32, "attention_mask": jnp.int32}
    return {k: jnp.asarray(batch[k], dtypes.get(k, jnp.float32)) for k in BATCH_KEYS}


def minibatches(batch: dict[str, Any], num: int) -> Iterator[dict[str, Any]]:
    """Splits a rollout batch into `num` equal consecutive mini-batches (one optimizer update each)."""
    b = batch["input_ids"].shape[0]
    if num < 1 or b % num:
        raise ValueError(f"cannot split a batch of {b} into {num} equal mini-batches")
    size = b // num
    for i in range(num):
        yield {k: v[i * size : (i + 1) * size] for k, v in batch.items()}


def make_train_step(
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
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """Builds `train_step(state, frozen, batch, ref_logp=None) -> (state, metrics)`.

    frozen: {"base", "norms"} (clean norms; any "lora" key is ignored). batch: see module doc.
    ref_logp: optional token-aligned [B, T] reference log-probs; when LossConfig.beta > 0 and it
      is None, they are computed in the step from the same base without LoRA.
    micro_batch_size: B is processed in B / micro_batch_size chunks under `lax.scan`, gradients
      summed (each micro-loss is normalised by the full batch's token/sequence count, so the
      update equals the full-batch one); None: one chunk.
    logprob_chunk: LM-head chunk size for `token_logprobs`; remat: per-layer checkpointing, one of
    `models.qwen2.REMAT_MODES` or a bool; attention: the full-sequence attention, one of
    `models.qwen2.ATTENTION_MODES` ("flash" needs each row's real tokens contiguous, which
    `validate_batch` checks).
    The jitted function donates `state`. A step whose loss or gradient is not finite leaves
    lora/opt_state/step unchanged and increments the skip counters (see `check_nonfinite`).
    Metrics: policy_loss's metrics + grad_norm (before clipping), skipped, consecutive_skips,
    step (updates applied after this step) and lr (of this update, when lr_schedule is given).
    """

    def logprobs(params, ids, mask):
        return token_logprobs(
            config,
            params,
            ids,
            mask,
            lora_scale=lora_scale,
            backend=backend,
            remat=remat,
            attention=attention,
            chunk_size=logprob_chunk,
            temperature=temperature,
        )

    def step_fn(state: TrainState, frozen, batch, ref_logp):
        b, t = batch["input_ids"].shape
        mb = micro_batch_size or b
        n_micro = b // mb
        resp = to_next_token_grid(batch["response_mask"]).astype(jnp.float32)
        old = to_next_token_grid(batch["old_logp"]).astype(jnp.float32)
        ref = None if ref_logp is None else to_next_token_grid(ref_logp).astype(jnp.float32)
        adv = batch["advantages"].astype(jnp.float32)
        normalizer = loss_normalizer(resp, loss_cfg)
        # Micro-batch i holds rows i, i + n_micro, ...: a batch sharded in contiguous blocks over
        # a "data" mesh axis then stays sharded within every micro-batch (each device runs its
        # share of every micro-step); consecutive rows per micro-batch would put the sharded
        # axis on the scanned one, and every device would run every micro-batch.
        split = lambda x: None if x is None else x.reshape(mb, n_micro, *x.shape[1:]).swapaxes(0, 1)  # noqa: E731
        xs = tuple(map(split, (batch["input_ids"], batch["attention_mask"], resp, old, adv, ref)))

        def micro(grad_acc, x):
            ids, am, rm, old_mb, adv_mb, ref_mb = x
            if ref_mb is None and loss_cfg.needs_ref:
                ref_mb = jax.lax.stop_gradient(logprobs(frozen, ids, am)[0])  # same base, LoRA off

            def loss_fn(lora):
                logp, ent = logprobs(with_lora(frozen, lora), ids, am)
                with jax.named_scope("loss"):
                    loss, _ = policy_loss(logp, old_mb, adv_mb, rm, loss_cfg, ref_logp=ref_mb, normalizer=normalizer)
                return loss, (logp, ent)

            (_, (logp, ent)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.lora)
            grad_acc = jax.tree.map(lambda a, gi: a + gi.astype(a.dtype), grad_acc, g)
            return grad_acc, (jax.lax.stop_gradient(logp), ent, ref_mb)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.lora)
        grads, (logp, ent, ref_used) = jax.lax.scan(micro, zeros, xs)
        unsplit = lambda x: None if x is None else x.swapaxes(0, 1).reshape(b, t - 1)  # noqa: E731
        logp, ent, ref_used = unsplit(logp), unsplit(ent), unsplit(ref_used)
        loss, metrics = policy_loss(
            logp, old, adv, resp, loss_cfg, ref_logp=ref_used, entropy=ent, normalizer=normalizer
        )

        grads = jax.tree.map(lambda gi, p: gi.astype(p.dtype), grads, state.lora)
        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        with jax.named_scope("optimizer"):
            updates, new_opt = optimizer.update(grads, state.opt_state, state.lora)
            new_lora = optax.apply_updates(state.lora, updates)
        keep = lambda new, old_: jax.tree.map(lambda a, c: jnp.where(ok, a, c), new, old_)  # noqa: E731
        skipped = (~ok).astype(jnp.int32)
        new_state = TrainState(
            lora=keep(new_lora, state.lora),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + (1 - skipped),
            consecutive_skips=jnp.where(ok, 0, state.consecutive_skips + 1),
            total_skips=state.total_skips + skipped,
        )
        metrics.update(
            grad_norm=grad_norm,
            skipped=skipped.astype(jnp.float32),
            consecutive_skips=new_state.consecutive_skips,
            step=new_state.step,
        )
        if lr_schedule is not None:
            metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
        return new_state, metrics

    jitted = jax.jit(step_fn, donate_argnums=(0,))
    checked_lora: list[Any] = []

    def train_step(state: TrainState, frozen: dict[str, Any], batch: dict[str, Any], ref_logp=None):
        validate_batch(batch, micro_batch_size, ref_logp, contiguous=attention == "flash")
        structure = jax.tree.structure(state.lora)
        if structure not in checked_lora:
            check_lora(state.lora, config)
            checked_lora.append(structure)
        ref = None if ref_logp is None else jnp.asarray(ref_logp, jnp.float32)
        return jitted(state, {"base": frozen["base"], "norms": frozen["norms"]}, train_arrays(batch), ref)

    train_step.jitted = jitted  # for lowering / memory analysis (benchmarks)
    return train_step
