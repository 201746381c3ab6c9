"""The QeRL training loop, top to bottom.

Each step: sample prompts -> rollouts of G completions per prompt on the quantized policy
(LoRA applied, AQN noise in the norms) -> rewards -> group advantages (DAPO dynamic sampling
refills groups whose rewards are all equal) -> train step(s) on the LoRA pytree -> metrics ->
checkpoint / eval. Every random draw derives from (seed, step), so a killed-and-resumed run
reproduces an uninterrupted one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from qerl_jax import (
    aqn,
    compile_cache,
    distributed,
    evaluation,
    fp8,
    linear,
    lora,
    memory,
    partial_rollouts,
    reward_guard,
    reward_pool,
    run_config,
    sharding,
    validate,
)
from qerl_jax.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointReadError,
    CheckpointWriteError,
    mismatch_message,
    resume_problems,
    saved_steps,
)
from qerl_jax.data import PromptLoader, filter_overlong, load_math_dataset
from qerl_jax.errors import UserFacingError
from qerl_jax.experience import Experience, collect_experience
from qerl_jax.metrics import MetricWriter, NullWriter, device_memory_stats
from qerl_jax.model_io.peft_adapter import AdapterWriteError, export_peft_adapter
from qerl_jax.policy import Policy, load_policy
from qerl_jax.rl import losses, packing
from qerl_jax.rl import step as rl_step
from qerl_jax.rollout import data_parallel
from qerl_jax.rollout.sampler import to_train_batch
from qerl_jax.run_config import RunConfig, loss_config, optimizer_from_config

# ----------------------------------------------------------------------------- one step's data


def make_train_batch(cfg: RunConfig, exp: Experience, micro_batch_size: int) -> dict[str, np.ndarray]:
    """Advantages + the train step's packed batch (`rl.packing`): every sequence's real tokens in rows
    of max_prompt_len + max_new_tokens slots, a multiple of the micro-batch of them; filler
    sequences (no tokens) keep the sequence count fixed."""
    g = cfg.rollout.group_size
    advantages = np.asarray(losses.group_advantages(exp.rewards, g, scale=cfg.rl.scale_rewards))
    batch = {k: np.asarray(v) for k, v in to_train_batch(exp.rollout).items()}
    if cfg.rl.mask_truncated:
        batch["response_mask"] = batch["response_mask"] * (~np.asarray(exp.rollout.truncated))[:, None]
    batch["advantages"] = advantages.astype(np.float32)
    return _packed(cfg, batch, micro_batch_size)


def _train_sequences(cfg: RunConfig, mb: int) -> int:
    """The sequences of every train batch: the step's, rounded up to a multiple of the micro-batch."""
    return -(-cfg.rollout.prompts_per_step * cfg.rollout.group_size // mb) * mb


def _packed(cfg: RunConfig, batch: dict[str, np.ndarray], micro_batch_size: int) -> dict[str, np.ndarray]:
    """A padded batch (advantages included) packed with every step's shapes: inert filler
    sequences (no tokens) up to `_train_sequences`, rows of max_prompt_len + max_new_tokens slots,
    a multiple of the micro-batch of them."""
    rows, n = _train_sequences(cfg, micro_batch_size), batch["input_ids"].shape[0]
    if n < rows:
        batch = {k: np.concatenate([v, np.zeros((rows - n, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    row_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    return packing.pack_batch(batch, row_len, rows_multiple=micro_batch_size)


def train_batch_like(cfg: RunConfig, micro_batch_size: int) -> dict[str, np.ndarray]:
    """A packed train batch of the shapes and dtypes `make_train_batch` gives every step (each
    sequence a prompt token and a response token): what the train programs are compiled for
    before the first step."""
    n = _train_sequences(cfg, micro_batch_size)
    ones = np.ones((n, 2), np.int32)
    batch = dict(
        input_ids=ones, attention_mask=ones, response_mask=np.tile(np.int32([0, 1]), (n, 1)),
        old_logp=np.zeros((n, 2), np.float32), advantages=np.zeros((n,), np.float32),
    )  # fmt: skip
    return _packed(cfg, batch, micro_batch_size)


def _precompile_in_background(
    train_step, state: rl_step.TrainState, frozen: dict[str, Any], batch: dict[str, Any]
) -> concurrent.futures.Future:
    """Compiles (or loads) the train step's programs in a thread while the first rollout runs:
    their compile (12 s of a cold 1.5B first step's 51 s on an H200) overlaps the rollout's. The
    returned future is awaited before the first train step."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-compile")
    future = pool.submit(train_step.precompile, state, frozen, batch)
    pool.shutdown(wait=False)
    return future


def _await_precompile(future: concurrent.futures.Future | None) -> None:
    """Waits for the background compile; if it failed (e.g. out of memory beside the rollout), the
    step compiles its programs itself."""
    if future is None:
        return
    try:
        future.result()
    except Exception as e:  # noqa: BLE001 (the step compiles again; nothing is lost)
        logging.warning(
            "compiling the train step beside the rollout failed (%s: %s); compiling it now", type(e).__name__, e
        )


# ----------------------------------------------------------------------------- the loop


def make_step(
    cfg: RunConfig, policy: Policy, optimizer, lr_fn, sizes: memory.Resolved, fp8_copies: bool = False
) -> rl_step.TrainStep:
    """The run's jitted train step: the config's settings with the sizes its memory plan resolved; with
    `fp8_copies` (the base's FP8 copies in its frozen input) compiled with `fp8.TRAIN_COMPILER_OPTIONS`."""
    return rl_step.TrainStep(
        policy.config,
        loss_config(cfg),
        optimizer,
        lora_scale=lora.lora_scale(cfg.lora),
        backend=policy.backend,
        remat=sizes.remat,
        attention=cfg.rl.attention,
        micro_batch_size=sizes.micro_batch_size,
        logprob_chunk=sizes.logprob_chunk,
        temperature=cfg.rollout.temperature,
        lr_schedule=lr_fn,
        compiler_options=fp8.TRAIN_COMPILER_OPTIONS if fp8_copies else None,
    )


def _checkpoint_meta(cfg: RunConfig, step: int, loader: PromptLoader, carry=(), mesh=None) -> dict[str, Any]:
    meta = {"step": step, "loader": loader.state(), "config": run_config.to_dict(cfg)}
    if carry:  # partial rollouts: the groups the next step resumes, each on its data shard of this layout
        meta["carry"] = partial_rollouts.to_meta(carry)
        meta["carry_shards"] = data_parallel.shard_count(mesh)
    return meta


def train(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Runs cfg.train.total_steps QeRL steps; returns the last step's metrics.

    The config is checked and made the run's typed tree first (`run_config.build`): nothing is
    loaded or written before every problem of it is reported. The workdir is then held
    (`workdir.lock`) until the run ends: a second run on it is refused.
    """
    t_start = time.perf_counter()
    distributed.initialize()  # before validate counts the devices of a mesh
    run = run_config.build(cfg, "train")
    mesh = distributed.run_mesh(run.mesh.data, run.mesh.model, run.rollout.prompts_per_step)
    with distributed.primary_lock(run.workdir):
        try:
            return _train(run, t_start, mesh)
        except jax.errors.JaxRuntimeError as e:
            distributed.stop_if_peer_lost(e)
            raise


@dataclasses.dataclass
class _Run:
    """One training run: what `_set_up` builds once (the policy and its mesh, the sizes of the memory
    plan, the jitted step, the prompts, the checkpoints, the writer) and the loop's state between steps."""

    cfg: RunConfig
    t_start: float
    mesh: jax.sharding.Mesh | None
    policy: Policy
    sizes: memory.Resolved
    state: rl_step.TrainState
    train_step: rl_step.TrainStep
    lr_fn: Callable[[int], Any]
    noisy_norms: Callable[..., Any]  # (frozen norms, trained norms, step) -> the rollout's norms (AQN)
    rollout_key: jax.Array
    loader: PromptLoader
    ckpt: Checkpointer
    writer: MetricWriter | NullWriter
    start: int  # the first step this invocation takes
    end: int  # one past its last (lowered when the time budget stops it)
    keep_rate: float = 1.0  # the share of groups with varied rewards, measured each step (paces admissions)
    compiling: concurrent.futures.Future | None = None  # the train step's background compile
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last step's
    carry: list = dataclasses.field(default_factory=list)  # partial rollouts: groups paused for the next step
    # the frozen base as the train step reads it: with its FP8 copies (`linear.fp8_train_base`), or None: policy.frozen
    train_base: dict[str, Any] | None = None

    @property
    def train_frozen(self) -> dict[str, Any]:
        return self.policy.frozen if self.train_base is None else self.train_base


def _train(cfg: RunConfig, t_start: float, mesh: jax.sharding.Mesh | None) -> dict[str, Any]:
    """The set-up, then one `_train_one_step` and one `_after_step` per step until the run's end or
    the time budget, then `_finish`; the last step's metrics."""
    run = _set_up(cfg, t_start, mesh)
    with reward_pool.RewardPool(cfg.rl.reward_workers or None, timeout_s=cfg.rl.reward_timeout_s) as pool:
        guard = reward_guard.RewardGuard(pool, cfg.rl.reward_failure_fraction, run.ckpt.directory)
        if run.start < run.end:
            run.compiling = _precompile_for(run)
        steps = range(run.start, run.end)
        total = cfg.train.total_steps
        bar = tqdm(
            steps, initial=run.start, total=total, desc="qerl", dynamic_ncols=True, disable=not distributed.is_primary()
        )
        for step in bar:
            _train_one_step(run, step, pool, guard)
            bar.set_postfix(
                reward=f"{run.metrics.get('reward/mean', float('nan')):.3f}",
                acc=f"{run.metrics.get('reward/accuracy', float('nan')):.3f}",
            )
            if not _after_step(run, step + 1):
                break
    return _finish(run)


# ----------------------------------------------------------------------------- set-up


def _set_up(cfg: RunConfig, t_start: float, mesh: jax.sharding.Mesh | None) -> _Run:
    """The run's workdir, compile cache, policy (sharded over the mesh), memory plan, train state
    (restored when resuming), step, prompts, checkpoints and writer, in that order."""
    os.makedirs(cfg.workdir, exist_ok=True)
    if cfg.compile_cache:
        compile_cache.enable_compilation_cache(compile_cache.cache_dir(cfg.compile_cache_dir))
    policy = distributed.primary_first(lambda: load_policy(cfg))  # a tiny model or GGUF conversion is written once
    sizes = _sized_for_mesh(cfg, policy, mesh)
    optimizer, lr_fn = optimizer_from_config(cfg)
    init_key, aqn_key, rollout_key = jax.random.split(jax.random.key(cfg.seed), 3)
    state = _init_state(cfg, policy, mesh, optimizer, init_key)
    train_base = _fp8_train_base(cfg, policy, mesh)
    train_step = make_step(cfg, policy, optimizer, lr_fn, sizes, fp8_copies=train_base is not None)
    noisy_norms = jax.jit(lambda norms, trained, step: rollout_norms(cfg.aqn, aqn_key, norms, trained, step))
    loader = PromptLoader(_train_prompts(cfg, policy), cfg.rollout.prompts_per_step, seed=cfg.seed)
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"))
    start = 0
    if cfg.resume:
        try:
            state, start = _resume(ckpt, state, loader, cfg)
        except CheckpointMismatchError as e:
            raise validate.ConfigError([f"cannot resume: {mismatch_message(e, run_config.to_dict(cfg))}"]) from None
    carry = _resumed_carry(ckpt.read_meta(start) if start else {}, cfg, mesh)
    logdir, purge_step = os.path.join(cfg.workdir, "tensorboard"), start if cfg.resume else None
    writer = MetricWriter(logdir, purge_step=purge_step) if distributed.is_primary() else NullWriter()  # process 0 logs
    tqdm.write(f"policy {policy.model_dir}: quant={policy.quant}, backend={policy.backend}, AQN={cfg.aqn.enabled}")
    total, stop_after = cfg.train.total_steps, cfg.train.stop_after_steps
    end = min(total, start + stop_after) if stop_after else total
    return _Run(
        cfg=cfg, t_start=t_start, mesh=mesh, policy=policy, sizes=sizes, state=state, train_step=train_step,
        lr_fn=lr_fn, noisy_norms=noisy_norms, rollout_key=rollout_key, loader=loader, ckpt=ckpt, writer=writer,
        start=start, end=end, carry=carry, train_base=train_base,
    )  # fmt: skip


def _resumed_carry(meta: dict[str, Any], cfg: RunConfig, mesh) -> list:
    """The groups the checkpoint paused (partial rollouts), each on the data shard that paused it; dealt
    anew over the shards when mesh.data changed (`partial_rollouts.deal`); none with max_staleness=0."""
    carry = partial_rollouts.from_meta(meta.get("carry"))
    if carry and not cfg.rollout.max_staleness:
        tqdm.write(f"resume: rollout.max_staleness=0: the {len(carry)} groups the checkpoint paused are dropped")
        return []
    saved, shards = int(meta.get("carry_shards", 1)), data_parallel.shard_count(mesh)
    if carry and saved != shards:
        tqdm.write(f"resume: the {len(carry)} groups the checkpoint paused on {saved} data shards are dealt "
                   f"round-robin over {shards}")  # fmt: skip
    return partial_rollouts.deal(carry, saved, shards)


def _uses_fp8(cfg: RunConfig, policy: Policy, model_shards: int) -> bool:
    """Whether the train step's base matmuls of many rows run on FP8 copies (model.fp8_matmul; not
    for a tensor-parallel base: the copies are made of whole weights)."""
    return model_shards == 1 and fp8.enabled(cfg.model.fp8_matmul, policy.quant != "bf16")


def _fp8_train_base(cfg: RunConfig, policy: Policy, mesh: jax.sharding.Mesh | None) -> dict[str, Any] | None:
    """The frozen base with its FP8 copies for the train step (`linear.fp8_train_base`), made once; None without."""
    if not _uses_fp8(cfg, policy, mesh.shape["model"] if mesh is not None else 1):
        return None
    train_base = linear.fp8_train_base(policy.frozen)
    size = fp8.train_copy_bytes(policy.frozen) / 2**30
    tqdm.write(f"train step: base matmuls of >= {fp8.MIN_ROWS} rows on FP8 copies of the base ({size:.2f} GiB)")
    return train_base


def _sized_for_mesh(cfg: RunConfig, policy: Policy, mesh: jax.sharding.Mesh | None) -> memory.Resolved:
    """The sizes of the run's memory plan (`_check_memory`), checked against the mesh's "data" size;
    the policy's base weights sharded tensor-parallel over the mesh."""
    data_shards = data_parallel.shard_count(mesh)
    sizes = _check_memory(cfg, policy, data_shards, model_shards=mesh.shape["model"] if mesh is not None else 1)
    if sizes.micro_batch_size % data_shards:
        raise UserFacingError(
            f"rl.micro_batch_size ({sizes.micro_batch_size}) must be a multiple of mesh.data ({data_shards}): "
            "each micro-batch is split over the data-parallel devices"
        )
    if mesh is not None:
        policy.frozen = sharding.shard_params(policy.frozen, mesh, "tp")
        tqdm.write(
            f"mesh {dict(mesh.shape)} over {jax.process_count()} process(es): base weights tensor-parallel over "
            "'model', each 'data' shard rolling out its own prompts, training batches data-parallel over 'data'"
        )
    return sizes


def _init_state(
    cfg: RunConfig, policy: Policy, mesh: jax.sharding.Mesh | None, optimizer, key: jax.Array
) -> rl_step.TrainState:
    """The step-0 train state: fresh LoRA factors (sharded like the base), the trained norms if any."""
    init = lora.init_lora(key, policy.config, cfg.lora)
    if mesh is not None:
        init = sharding.shard_like_lora(init, mesh, "tp")
    norms = lora.init_trained_norms(policy.frozen["norms"]) if cfg.lora.train_norms else None
    return rl_step.init_train_state(init, optimizer, norms)


def _train_prompts(cfg: RunConfig, policy: Policy) -> Any:
    """The training set (a `datasets.Dataset`) without the prompts longer than data.max_prompt_len; too
    few left is an error."""
    dataset = load_math_dataset(cfg.data.train, max_bad_fraction=cfg.data.max_bad_fraction)
    dataset, dropped = filter_overlong(
        dataset, policy.tokenizer, cfg.data.max_prompt_len, cfg.data.template, system_prompt=cfg.data.system_prompt
    )
    tqdm.write(
        f"train prompts: {len(dataset)} kept, {dropped} longer than data.max_prompt_len={cfg.data.max_prompt_len} dropped"
    )
    if len(dataset) < cfg.rollout.prompts_per_step:
        raise UserFacingError(
            f"only {len(dataset)} training prompts fit data.max_prompt_len={cfg.data.max_prompt_len}; "
            f"need at least rollout.prompts_per_step={cfg.rollout.prompts_per_step}: raise data.max_prompt_len"
        )
    return dataset


def _precompile_for(run: _Run) -> concurrent.futures.Future:
    """The train step's programs compiling in the background for the batch shapes of every step."""
    spec_batch = train_batch_like(run.cfg, run.sizes.micro_batch_size)
    if run.mesh is not None:
        spec_batch = sharding.shard_batch(spec_batch, run.mesh)
    return _precompile_in_background(run.train_step, run.state, run.train_frozen, spec_batch)


# ----------------------------------------------------------------------------- one step


def _train_one_step(run: _Run, step: int, pool: reward_pool.RewardPool, guard: reward_guard.RewardGuard) -> None:
    """Step `step`: rollouts on the AQN-noised policy, rewards, the train step(s) on the kept groups
    (none when no group has varied rewards), the step's metrics in `run.metrics`, logged every
    train.log_every steps."""
    cfg = run.cfg
    t_step = time.perf_counter()
    sigma = float(aqn.aqn_sigma(cfg.aqn, step))
    exp, metrics = _collect(run, step, pool, guard)
    metrics.update({"aqn/sigma": sigma, "optim/lr": float(run.lr_fn(int(run.state.step)))})
    if exp is None:
        logging.warning("step %d: no group with varied rewards after refills; no update", step)
    else:
        metrics.update(_rollout_metrics(exp))
        metrics.update(_update(run, exp))
        if cfg.train.sample_every and step % cfg.train.sample_every == 0:
            run.writer.text(step, "samples", _samples_markdown(exp))
    metrics["time/step_s"] = time.perf_counter() - t_step
    metrics.update(device_memory_stats())
    if step % cfg.train.log_every == 0:
        run.writer.scalars(step, metrics)
    run.metrics = metrics


def _collect(
    run: _Run, step: int, pool: reward_pool.RewardPool, guard: reward_guard.RewardGuard
) -> tuple[Experience | None, dict[str, Any]]:
    """The step's experience (None: no kept group) on the rollout policy, the current LoRA with the
    step's AQN noise in its norms, and its metrics, the reward workers' faults of the step included.
    A reward failing on (nearly) every completion stops the run here (`guard`), before it trains."""
    rollout_params = {
        "base": run.policy.frozen["base"],
        "norms": run.noisy_norms(run.policy.frozen["norms"], run.state.norms, step),
        "lora": run.state.lora,
    }
    pool_before = dict(pool.stats)
    try:
        if run.cfg.rollout.max_staleness:  # partial rollouts: groups paused here resume in the next step
            exp, metrics, run.carry = partial_rollouts.collect_partial(
                run.cfg, run.policy, rollout_params, run.loader, pool, jax.random.fold_in(run.rollout_key, step),
                run.carry, step, run.keep_rate, run.mesh, max_batch=run.sizes.max_batch or None,
            )  # fmt: skip
        else:
            exp, metrics = collect_experience(
                run.cfg,
                run.policy,
                rollout_params,
                run.loader,
                pool,
                jax.random.fold_in(run.rollout_key, step),
                run.mesh,
                run.keep_rate,
                max_batch=run.sizes.max_batch or None,
            )
        run.keep_rate = metrics["rollout/keep_rate"]
    except MemoryError as e:
        raise UserFacingError(f"out of device memory in the rollout: {e}") from None
    guard.check_step(step)
    # Completions whose reward worker hung (timeouts) or died (crashes) scored 0.
    for kind in ("timeouts", "crashes", "errors"):
        metrics[f"reward/worker_{kind}"] = float(pool.stats[kind] - pool_before.get(kind, 0))
    return exp, metrics


def _update(run: _Run, exp: Experience) -> dict[str, float]:
    """rl.ppo_epochs train steps on the experience's packed batch (`run.state` updated); their metrics."""
    t0 = time.perf_counter()
    batch = make_train_batch(run.cfg, exp, run.sizes.micro_batch_size)
    counts = packing.token_counts(batch)
    if run.mesh is not None:
        batch = sharding.shard_batch(batch, run.mesh)
    _await_precompile(run.compiling)
    run.compiling = None
    try:
        for _ in range(run.cfg.rl.ppo_epochs):
            run.state, train_metrics = run.train_step(run.state, run.train_frozen, batch)
        train_metrics = jax.device_get(train_metrics)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            raise UserFacingError(
                "out of device memory in the train step: lower --config.rl.micro_batch_size "
                f"(now {run.sizes.micro_batch_size}) or --config.rollout.max_new_tokens, or keep "
                "--config.rl.remat=full"
            ) from None
        raise
    dt = time.perf_counter() - t0
    metrics = {f"train/{k}": float(v) for k, v in train_metrics.items()}
    metrics["train/skipped_total"] = float(run.state.total_skips)  # non-finite steps so far
    metrics["time/train_s"] = dt
    metrics["train/tokens_per_s"] = counts["real"] / max(dt, 1e-9)
    metrics["train/packed_fill"] = counts["real"] / max(counts["computed"], 1)
    return metrics


def _after_step(run: _Run, done: int) -> bool:
    """After `done` steps: the non-finite check, the checkpoint (every train.checkpoint_every steps, at
    the end, or when the time budget is spent), the periodic eval. False: stop (time budget spent)."""
    cfg, ckpt = run.cfg, run.ckpt
    try:
        rl_step.check_nonfinite(run.state, cfg.train.max_nonfinite)
    except rl_step.NonFiniteError as e:
        # Skipped steps leave the LoRA and optimizer state as the last good step made them.
        _save(ckpt, done, run.state, _checkpoint_meta(cfg, done, run.loader, run.carry, run.mesh))
        raise UserFacingError(f"{e} The last good LoRA state is saved in {ckpt.directory}/{done}.") from None
    out_of_time = 0 < cfg.train.stop_after_minutes < (time.perf_counter() - run.t_start) / 60
    if done % cfg.train.checkpoint_every == 0 or done == run.end or out_of_time:
        _save(ckpt, done, run.state, _checkpoint_meta(cfg, done, run.loader, run.carry, run.mesh))
    if out_of_time and done < run.end:
        tqdm.write(
            f"stopping after step {done}: train.stop_after_minutes={cfg.train.stop_after_minutes} reached; "
            "continue with --config.resume=True"
        )
        run.end = done
        return False
    periodic_eval = cfg.eval.num_examples and cfg.train.eval_every and done % cfg.train.eval_every == 0
    if periodic_eval and done != cfg.train.total_steps:  # the last step's eval is `_finish`'s
        _periodic_eval(cfg, run.policy, run.state, run.writer, done, run.mesh, run.sizes.max_batch or None)
    return True


# ----------------------------------------------------------------------------- the end


def _finish(run: _Run) -> dict[str, Any]:
    """The end of this invocation: at the run's last step the final eval and the PEFT adapter (written
    by process 0); then the writer and checkpoints closed and the summary printed. The last step's metrics."""
    cfg, primary = run.cfg, distributed.is_primary()
    eval_metrics: dict[str, float] = {}
    if run.end == cfg.train.total_steps:
        if cfg.eval.num_examples:
            eval_metrics = _periodic_eval(
                cfg, run.policy, run.state, run.writer, run.end, run.mesh, run.sizes.max_batch or None
            )
        trained_lora, trained_norms = distributed.host_copy((run.state.lora, run.state.norms))
        if primary:
            _export_adapter(cfg, run.policy, trained_lora, trained_norms, run.ckpt.directory)
    run.writer.close()
    run.ckpt.close()
    distributed.barrier("qerl-run-end")  # a peer lost near the end is one line here, not an abort at exit
    if primary:
        seconds = time.perf_counter() - run.t_start
        tqdm.write(run_summary(cfg, run.start, run.end, run.metrics, eval_metrics, run.ckpt.directory, seconds))
    return run.metrics


def _export_adapter(cfg: RunConfig, policy: Policy, trained_lora, trained_norms, checkpoint_dir: str) -> None:
    """The trained LoRA (and norms) as a PEFT adapter in workdir/adapter."""
    try:
        export_peft_adapter(
            trained_lora,
            os.path.join(cfg.workdir, "adapter"),
            norms=trained_norms,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            rslora=cfg.lora.rslora,
            base_model_name_or_path=os.path.abspath(policy.model_dir),
        )
    except AdapterWriteError as e:
        raise UserFacingError(f"{e}; the run's last checkpoint in {checkpoint_dir} is intact") from None


def rollout_norms(acfg: aqn.AQNConfig, key: jax.Array, frozen_norms, trained_norms, step):
    """The rollout policy's norms at `step`: the trained scales (None: the frozen ones) in place of the
    frozen per-layer ones, plus AQN's noise of the step (`aqn.apply_aqn`; as QeRL, which syncs the
    trained norms into the rollout model and then adds the noise)."""
    return aqn.apply_aqn(acfg, lora.merge_norms(frozen_norms, trained_norms), key, step)


def _resume(
    ckpt: Checkpointer, state: rl_step.TrainState, loader: PromptLoader, cfg: RunConfig
) -> tuple[rl_step.TrainState, int]:
    """(state, step) of the newest readable checkpoint, skipping damaged ones; step 0 if there is none.
    The recipe changes `resume_changes` allowed (validate refused the others) are logged."""
    try:
        found = ckpt.restore_latest(like=state)
    except CheckpointReadError as e:
        raise UserFacingError(
            f"cannot resume: {e}. Not starting from scratch over an existing run: move {ckpt.directory} away "
            "to start over"
        ) from None
    if found is None:
        tqdm.write(f"resume: no checkpoint in {ckpt.directory} yet; starting at step 0")
        return state, 0
    for problem in found.skipped:
        tqdm.write(f"resume: skipping the unreadable checkpoint {problem}")
    loader.restore(found.meta["loader"])
    tqdm.write(f"resumed from step {found.step} in {ckpt.directory}")
    for note in resume_problems(run_config.to_dict(cfg), found.meta.get("config"), found.step, ckpt.directory)[1]:
        tqdm.write(f"resume: {note}")
    return found.state, int(found.meta["step"])


def _save(ckpt: Checkpointer, step: int, state: rl_step.TrainState, meta: dict[str, Any]) -> None:
    try:
        ckpt.save(step, state, meta)
    except CheckpointWriteError as e:
        previous = ckpt.latest_step()
        kept = (
            f"the previous checkpoint (step {previous}) is intact" if previous is not None else "no earlier checkpoint"
        )
        raise UserFacingError(
            f"{e}. Stopped; {kept}. Free space (or fix the cause) and continue with --config.resume=True"
        ) from None


def run_summary(
    cfg: RunConfig,
    start: int,
    end: int,
    metrics: dict[str, Any],
    eval_metrics: dict[str, float],
    checkpoint_dir: str,
    seconds: float,
) -> str:
    """The lines printed when a run (or an invocation of it) ends: what it did and where its outputs are."""
    total = cfg.train.total_steps
    lines = [f"done: steps {start} -> {end} of {total} in {seconds / 60:.1f} min"]
    if "reward/mean" in metrics:
        lines.append(
            f"  last step: reward {metrics['reward/mean']:.3f}, accuracy {metrics.get('reward/accuracy', 0.0):.3f}"
        )
    for name, value in sorted(eval_metrics.items()):
        if not name.endswith(("_seconds", "_response_length")):
            lines.append(f"  eval {name}: {value:.3f}")
    steps = saved_steps(checkpoint_dir)
    if steps:
        lines.append(f"  last checkpoint: {os.path.join(checkpoint_dir, str(steps[-1]))}")
    if end == total:
        lines.append(f"  adapter (PEFT): {os.path.abspath(os.path.join(cfg.workdir, 'adapter'))}")
    else:
        lines.append(f"  continue with: --config.resume=True (workdir {os.path.abspath(cfg.workdir)})")
    logdir = os.path.abspath(os.path.join(cfg.workdir, "tensorboard"))
    lines.append(f"  TensorBoard: tensorboard --logdir {logdir}")
    return "\n".join(lines)


def _check_memory(cfg: RunConfig, policy: Policy, data_devices: int = 1, model_shards: int = 1) -> memory.Resolved:
    """Prints the memory plan and returns the sizes the run trains and rolls out with. On a device
    that reports its memory, the micro-batch and rollout rows (rollout.max_batch) are fitted to it
    (or the run stops with the config value to lower), and auto (0) rl.micro_batch_size and
    rl.logprob_chunk are the largest that fit (`memory.fit`); on a device of unknown size they are
    memory.DEFAULT_MICRO_BATCH / DEFAULT_LOGPROB_CHUNK. `cfg` is left as written. data_devices: the
    mesh's "data" size (a micro-batch is split over it, so auto picks multiples of it); model_shards:
    its "model" size (the base is split over it)."""
    plan = _memory_plan(cfg, policy, data_devices, model_shards)
    auto_remat = cfg.rl.remat == "auto"
    device_bytes = memory.device_memory_bytes()
    if device_bytes is None:
        tqdm.write(plan.table())
        return memory.Resolved(
            micro_batch_size=plan.inputs.micro_batch_size,
            logprob_chunk=cfg.rl.logprob_chunk or plan.inputs.logprob_chunk,
            remat="full" if auto_remat else cfg.rl.remat,
            max_batch=cfg.rollout.max_batch,
        )
    auto_mb, auto_chunk = cfg.rl.micro_batch_size == 0, cfg.rl.logprob_chunk == 0
    try:
        result = memory.fit(
            plan,
            device_bytes,
            remat_fallback=auto_remat,
            auto_micro_batch=auto_mb,
            auto_logprob_chunk=auto_chunk,
            micro_batch_multiple=data_devices,
        )
    except memory.DoesNotFitError as e:
        tqdm.write(plan.table())
        raise UserFacingError(str(e)) from None
    tqdm.write(result.plan.table())
    if result.changed or auto_mb or auto_chunk:
        tqdm.write(result.message)
    return memory.Resolved(
        micro_batch_size=result.micro_batch_size,
        logprob_chunk=cfg.rl.logprob_chunk or result.logprob_chunk,
        remat=result.remat,
        max_batch=result.max_batch if cfg.rollout.max_batch else 0,  # 0: the rollout sizes its rows itself
    )


def _memory_plan(cfg: RunConfig, policy: Policy, data_devices: int, model_shards: int) -> memory.MemoryPlan:
    """The run's memory plan, auto sizes at their defaults ("auto" remat as "proj", which `fit` may lower)."""
    rollout_batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    inputs = memory.PlanInputs(
        quant=policy.quant,
        quant_skip=("embed", "lm_head") + tuple(cfg.model.quant_skip),
        lora_rank=cfg.lora.rank,
        lora_targets=cfg.lora.targets,
        rollout_batch=rollout_batch,
        max_batch=cfg.rollout.max_batch or None,
        group_size=cfg.rollout.group_size,
        prompt_len=cfg.data.max_prompt_len,
        max_new_tokens=cfg.rollout.max_new_tokens,
        micro_batch_size=cfg.rl.micro_batch_size or memory.default_micro_batch(rollout_batch, data_devices),
        remat="proj" if cfg.rl.remat == "auto" else cfg.rl.remat,
        attention=cfg.rl.attention,
        logprob_chunk=cfg.rl.logprob_chunk or memory.DEFAULT_LOGPROB_CHUNK,
        backend=policy.backend,
        train_norms=cfg.lora.train_norms,
        data_shards=data_devices,
        model_shards=model_shards,
        fp8_copies=_uses_fp8(cfg, policy, model_shards),
    )
    return memory.plan_memory(policy.config, inputs)


def _rollout_metrics(exp: Experience) -> dict[str, float]:
    """The trained completions' rewards and lengths; the length quantiles show a bias toward short or long
    answers that the mean hides."""
    lengths = np.asarray(exp.rollout.lengths, np.float32)
    p10, p50, p90 = np.percentile(lengths, (10, 50, 90))
    return {
        "reward/mean": float(exp.rewards.mean()),
        "reward/std": float(exp.rewards.std()),
        "reward/accuracy": float(exp.accuracy.mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_p10": float(p10),
        "rollout/response_length_p50": float(p50),
        "rollout/response_length_p90": float(p90),
        "rollout/truncated_frac": float(np.asarray(exp.rollout.truncated).mean()),
    }


def _samples_markdown(exp: Experience, n: int = 2) -> str:
    out = []
    for i in range(min(n, len(exp.completions))):
        out.append(
            f"**prompt:** {exp.prompts[i]}\n\n**completion:** {exp.completions[i]}\n\n"
            f"**answer:** {exp.answers[i]} | **reward:** {exp.rewards[i]:.2f}"
        )
    return "\n\n---\n\n".join(out)


def _periodic_eval(
    cfg: RunConfig, policy: Policy, state, writer, step: int, mesh, max_batch: int | None
) -> dict[str, float]:
    """Evaluation of the current adapter, on this process's first data shard, max_batch rollout rows
    at once (the run's resolved rows). Every process of a multi-process run evaluates (they stay in
    step); the primary's outputs are kept."""
    params = lora.with_lora(policy.frozen, state.lora, state.norms)
    if mesh is not None:
        params = data_parallel.on_submesh(params, data_parallel.local_shards(mesh)[0][1])
    with contextlib.ExitStack() as stack:
        output_dir = os.path.join(cfg.workdir, "eval", f"step_{step}")
        if not distributed.is_primary():
            output_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="qerl-eval-"))
        summary = evaluation.evaluate_params(
            cfg,
            policy,
            params,
            lora_scale=lora.lora_scale(cfg.lora),
            output_dir=output_dir,
            writer=writer,
            step=step,
            max_batch=max_batch,
        )
    return summary["metrics"]
