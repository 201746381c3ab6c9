"""A run's config as one typed, frozen tree: the ConfigDict checked and converted once, at the start.

`build(cfg, command)` checks the ConfigDict (`validate.validate_config`: each field's type and range,
the rules between fields, the files the command reads; every problem at once, by its config path,
as a `ConfigError`) and returns a `RunConfig`: the sections that `qerl_jax.config` declares
(`run.rollout.group_size` is `--config.rollout.group_size`), with lora and aqn as the library's
`lora.LoraConfig` and `aqn.AQNConfig` (`enabled` resolved against the quantization, `total_steps` from
train). The library's configs are built here, each from the section fields of the same names
(`loss_config`, `sampling_config`, LoRA, AQN) or, for the optimizer, by name. Below the run's set-up only
the tree is read; a change during the run (the memory fit's micro-batch) is a `dataclasses.replace`.
`to_dict` is the saved form (the ConfigDict's layout, as JSON), which checkpoints store."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import optax

from qerl_jax import aqn, config, lora, optim, schema, validate
from qerl_jax.rl.losses import LossConfig
from qerl_jax.rollout.sampler import RolloutOptions
from qerl_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RunConfig(config.Settings):
    """The whole run's config: the sections of `config.Settings` (`--config.<section>.<field>`), with
    lora and aqn as the library's configs (aqn.enabled resolved, aqn.total_steps from train)."""

    lora: lora.LoraConfig = dataclasses.field(default_factory=lora.LoraConfig)
    aqn: aqn.AQNConfig = dataclasses.field(default_factory=aqn.AQNConfig)


def build(cfg: ml_collections.ConfigDict, command: str = "train") -> RunConfig:
    """The checked tree of `cfg` for `command` ("train" or "eval"); raises validate.ConfigError listing
    every problem (by config path) before anything is loaded or written."""
    validate.validate_config(cfg, command)
    return from_config_dict(cfg, command)


def from_config_dict(cfg: ml_collections.ConfigDict, command: str = "train") -> RunConfig:
    """The tree of a ConfigDict whose fields are valid (`build` checks them first); sequences become tuples.

    For "eval", which samples without AQN's noise (and is not checked by its rules), aqn.enabled is False.
    """
    values = _section_values(config.Settings, cfg)
    enabled = command == "train" and validate.aqn_enabled(cfg.aqn.enabled, cfg.model.quant)
    values["lora"] = _library(lora.LoraConfig, values["lora"])
    values["aqn"] = _library(aqn.AQNConfig, values["aqn"], enabled=enabled, total_steps=cfg.train.total_steps)
    return RunConfig(**values)


def _section_values(cls: type, node: ml_collections.ConfigDict) -> dict[str, Any]:
    """The fields of section `cls` that `node` sets, by name (subsections built as their classes)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in node:
            continue
        sub = f.metadata.get("section")
        out[f.name] = sub(**_section_values(sub, node[f.name])) if sub else _tuples(node[f.name])
    return out


def _library(cls: type, section: Any, **resolved) -> Any:
    """The library config `cls` from the fields of the section object `section` of the same names, and `resolved`."""
    shared = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(section)}
    return cls(**{name: getattr(section, name) for name in shared - set(resolved)}, **resolved)


def to_dict(run: RunConfig) -> dict[str, Any]:
    """The tree in the ConfigDict's layout as JSON values (what a checkpoint stores as its "config");
    aqn.enabled is the resolved value."""
    out: dict[str, Any] = {}
    for leaf in schema.leaves(config.Settings):
        *sections, name = leaf.path.split(".")
        node, target = run, out
        for part in sections:
            node, target = getattr(node, part), target.setdefault(part, {})
        target[name] = _lists(getattr(node, name))
    return out


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _lists(value: Any) -> Any:
    return [_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------- library objects of the tree


def loss_config(run: RunConfig) -> LossConfig:
    """The policy loss of rl.* (rl.loss its kind), normalized over rollout.max_new_tokens (Dr. GRPO)."""
    return _library(LossConfig, run.rl, kind=run.rl.loss, max_completion_len=run.rollout.max_new_tokens)


def sampling_config(run: RunConfig, policy) -> SamplingConfig:
    """The rollout's sampling (rollout.*), stopping at `policy`'s stop ids and padding with its pad id."""
    return _library(SamplingConfig, run.rollout, eos_ids=policy.stop_ids, pad_id=policy.pad_id)


def rollout_options(run: RunConfig, policy) -> RolloutOptions:
    """The engine's options of a run's rollouts (training and evaluation alike): `policy`'s matmul
    backend, prompts padded to data.max_prompt_len, the FP8 copies of model.fp8_matmul and the
    one-row step's norms of rollout.norm_parts, the tail's buckets of rollout.compaction_rows."""
    return RolloutOptions(
        backend=policy.backend, min_prompt_len=run.data.max_prompt_len, fp8_matmul=run.model.fp8_matmul,
        norm_parts=run.rollout.norm_parts, smaller_rows=tuple(run.rollout.compaction_rows),
    )  # fmt: skip


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
