"""A run's config as one typed, frozen tree: the ConfigDict checked and converted once, at the start.

`build(cfg, command)` checks the ConfigDict (`validate.validate_config`: each field's type and range,
the rules between fields, the files the command reads; every problem at once, by its config path,
as a `ConfigError`) and returns a `RunConfig`. Its sections carry the ConfigDict's names
(`run.rollout.group_size` is `--config.rollout.group_size`); the library's own config types are
sections where they fit (`lora.LoraConfig`; `aqn.AQNConfig` with `enabled` resolved against the
quantization and `total_steps` from train), and the others (`losses.LossConfig`, `SamplingConfig`,
the optimizer) are built from the sections here. Below the run's set-up only the tree is read; a
change during the run (the memory fit's micro-batch) is a `dataclasses.replace`. `to_dict` is the
saved form (the ConfigDict's layout, as JSON), which checkpoints store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import optax

from qerl_jax import aqn, lora, optim, validate
from qerl_jax.config import default_config
from qerl_jax.rl.losses import LossConfig
from qerl_jax.rollout.sampling import SamplingConfig

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class ModelSection:
    path: str
    tiny: bool
    dtype: str
    quant: str
    quant_skip: tuple[str, ...]
    backend: str
    cache_dir: str


@_frozen
class DataSection:
    train: str
    eval: str
    system_prompt: str | None
    template: str
    max_prompt_len: int
    max_bad_fraction: float


@_frozen
class RolloutSection:
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    max_batch: int


@_frozen
class RLSection:
    loss: str
    eps_low: float
    eps_high: float
    beta: float
    old_logp_source: str
    is_correction: str
    is_cap: float
    scale_rewards: str
    reward: str
    reward_weights: tuple[float, ...]
    reward_timeout_s: float
    reward_failure_fraction: float
    dynamic_sampling: bool
    max_refill_rounds: int
    mask_truncated: bool
    overlong_cache: int
    overlong_penalty: float
    micro_batch_size: int
    ppo_epochs: int
    logprob_chunk: int
    remat: str
    attention: str
    reward_workers: int


@_frozen
class OptimSection:
    lr: float
    warmup_frac: float
    schedule: str
    b1: float
    b2: float
    weight_decay: float
    clip_norm: float


@_frozen
class TrainSection:
    total_steps: int
    log_every: int
    sample_every: int
    checkpoint_every: int
    eval_every: int
    max_nonfinite: int
    stop_after_steps: int
    stop_after_minutes: float


@_frozen
class EvalSection:
    checkpoint: str
    datasets: tuple[str, ...]
    num_examples: int
    batch_size: int
    max_new_tokens: int
    num_samples: int
    temperature: float
    top_p: float
    output_dir: str


@_frozen
class MeshSection:
    data: int
    model: int


@_frozen
class RunConfig:
    """The whole run's config; each section as its ConfigDict section (`--config.<section>.<field>`)."""

    seed: int
    workdir: str
    resume: bool
    resume_changes: str
    compile_cache: bool
    compile_cache_dir: str
    model: ModelSection
    data: DataSection
    rollout: RolloutSection
    rl: RLSection
    lora: lora.LoraConfig
    aqn: aqn.AQNConfig
    optim: OptimSection
    train: TrainSection
    eval: EvalSection
    mesh: MeshSection


def build(cfg: ml_collections.ConfigDict, command: str = "train") -> RunConfig:
    """The checked tree of `cfg` for `command` ("train" or "eval"); raises validate.ConfigError listing
    every problem (by config path) before anything is loaded or written."""
    validate.validate_config(cfg, command)
    return from_config_dict(cfg, command)


def from_config_dict(cfg: ml_collections.ConfigDict, command: str = "train") -> RunConfig:
    """The tree of a ConfigDict whose fields are valid (`build` checks them first); sequences become tuples.

    For "eval", which samples without AQN's noise (and is not checked by its rules), aqn.enabled is False.
    """

    def section(cls, name: str, **resolved):
        node = cfg[name]
        values = {f.name: _tuples(node[f.name]) for f in dataclasses.fields(cls) if f.name in node}
        return cls(**{**values, **resolved})

    return RunConfig(
        seed=cfg.seed,
        workdir=cfg.workdir,
        resume=cfg.resume,
        resume_changes=cfg.resume_changes,
        compile_cache=cfg.compile_cache,
        compile_cache_dir=cfg.compile_cache_dir,
        model=section(ModelSection, "model"),
        data=section(DataSection, "data"),
        rollout=section(RolloutSection, "rollout"),
        rl=section(RLSection, "rl"),
        lora=section(lora.LoraConfig, "lora"),
        aqn=section(
            aqn.AQNConfig,
            "aqn",
            enabled=command == "train" and validate.aqn_enabled(cfg.aqn.enabled, cfg.model.quant),
            total_steps=cfg.train.total_steps,
        ),
        optim=section(OptimSection, "optim"),
        train=section(TrainSection, "train"),
        eval=section(EvalSection, "eval"),
        mesh=section(MeshSection, "mesh"),
    )


def to_dict(run: RunConfig) -> dict[str, Any]:
    """The tree in the ConfigDict's layout as JSON values (what a checkpoint stores as its "config");
    aqn.enabled is the resolved value."""

    def walk(node: Any, layout: ml_collections.ConfigDict) -> dict[str, Any]:
        out = {}
        for key, ref in layout.items():
            value = getattr(node, key)
            out[key] = walk(value, ref) if isinstance(ref, ml_collections.ConfigDict) else _lists(value)
        return out

    return walk(run, default_config())


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _lists(value: Any) -> Any:
    return [_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------- library objects of the tree


def loss_config(run: RunConfig) -> LossConfig:
    """The policy loss of rl.*, normalized over rollout.max_new_tokens (Dr. GRPO)."""
    rl = run.rl
    return LossConfig(
        kind=rl.loss,
        eps_low=rl.eps_low,
        eps_high=rl.eps_high,
        beta=rl.beta,
        old_logp_source=rl.old_logp_source,
        is_correction=rl.is_correction,
        is_cap=rl.is_cap,
        max_completion_len=run.rollout.max_new_tokens,
    )


def sampling_config(run: RunConfig, policy) -> SamplingConfig:
    """The rollout's sampling (rollout.*), stopping at `policy`'s stop ids and padding with its pad id."""
    r = run.rollout
    return SamplingConfig(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        eos_ids=policy.stop_ids,
        pad_id=policy.pad_id,
    )


def optimizer_from_config(run: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warm-up + cosine/constant schedule and grad clipping; also the lr schedule."""
    o, total = run.optim, run.train.total_steps
    warmup = int(round(o.warmup_frac * total))
    optimizer = optim.make_optimizer(
        o.lr,
        warmup_steps=warmup,
        total_steps=total,
        schedule=o.schedule,
        b1=o.b1,
        b2=o.b2,
        weight_decay=o.weight_decay,
        clip_norm=o.clip_norm,
    )
    return optimizer, optim.make_schedule(o.lr, warmup_steps=warmup, total_steps=total, schedule=o.schedule)
