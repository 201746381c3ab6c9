"""LoRA adapters as their own pytree, separate from the frozen base and the norms.

Layout (see the shared conventions): ``lora = {"layers": {proj: {"a": [L, r, K], "b": [L, N, r]}}}``
for each targeted projection, stacked over layers like the base weights. A projection then
computes ``y = x @ W.T + scale * (x @ a.T) @ b.T`` with ``scale = lora_scale(cfg)`` passed to the
forward as a static float. This pytree is what goes to optax, with, when the norms train too
(QeRL's `--ln True`, config lora.train_norms), the trained RMSNorm scales
``{"layers": {name: [L, D] float32}}`` for name in TRAINED_NORMS (the final norm stays frozen):
a second trainable pytree, float32 masters initialised from the frozen scales.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from qerl_jax.models.qwen2 import PROJECTIONS, ModelConfig, projection_shapes


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (PEFT names: r, lora_alpha, target_modules, use_rslora, lora_dropout).

    dropout must be 0: the model forward takes no dropout PRNG key, so LoRA dropout is not
    implemented (QeRL's RL runs use none); a non-zero value is rejected, not ignored.
    """

    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = PROJECTIONS
    rslora: bool = False
    dropout: float = 0.0
    train_norms: bool = False  # also train the per-layer RMSNorm scales (PEFT modules_to_save)

    def __post_init__(self):
        if isinstance(self.targets, str):
            raise ValueError(f"LoraConfig.targets must be a tuple of projection names, got the string {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int; got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0; got {self.alpha!r}")
        if not self.targets:
            raise ValueError(f"LoraConfig.targets is empty; expected a non-empty subset of {PROJECTIONS}")
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown:
            raise ValueError(
                f"LoraConfig.targets has unknown projection name(s) {unknown}; expected names from {PROJECTIONS}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoraConfig.targets has duplicates: {self.targets}")
        if self.dropout != 0.0:
            raise ValueError(
                f"LoraConfig.dropout={self.dropout}: LoRA dropout is not implemented (the model forward takes no "
                "dropout RNG key); set dropout=0.0"
            )


def lora_scale(cfg: LoraConfig) -> float:
    """The LoRA output multiplier: alpha / r, or alpha / sqrt(r) with rsLoRA (as PEFT)."""
    return float(cfg.alpha / (math.sqrt(cfg.rank) if cfg.rslora else cfg.rank))


def init_lora(key: jax.Array, config: ModelConfig, cfg: LoraConfig, dtype=jnp.float32) -> dict[str, Any]:
    """A fresh adapter: A [L, r, K] ~ U(-1/sqrt(K), 1/sqrt(K)), B [L, N, r] = 0.

    A's distribution is PEFT's default (`kaiming_uniform_(a=sqrt(5))` on a [r, K] matrix has
    bound sqrt(6 / ((1 + 5) K)) = 1/sqrt(K)), drawn independently for every layer. B = 0 makes
    the adapted model start exactly at the base model.
    """
    shapes = projection_shapes(config)
    n_layers = config.num_hidden_layers
    layers = {}
    for i, proj in enumerate(PROJECTIONS):  # fixed order: the key of a projection doesn't depend on the others
        if proj not in cfg.targets:
            continue
        n, k = shapes[proj]
        bound = 1.0 / math.sqrt(k)
        a = jax.random.uniform(jax.random.fold_in(key, i), (n_layers, cfg.rank, k), jnp.float32, -bound, bound)
        layers[proj] = {"a": a.astype(dtype), "b": jnp.zeros((n_layers, n, cfg.rank), dtype)}
    return {"layers": layers}


def check_lora(lora: dict[str, Any], config: ModelConfig) -> int:
    """Validates a LoRA pytree's structure and shapes against the model; returns its rank."""
    if not isinstance(lora, dict) or not isinstance(lora.get("layers"), dict) or not lora["layers"]:
        raise ValueError(
            "LoRA pytree must be {'layers': {proj: {'a': [L, r, K], 'b': [L, N, r]}}} with >= 1 projection"
        )
    shapes = projection_shapes(config)
    ranks = set()
    for proj, ab in lora["layers"].items():
        if proj not in shapes:
            raise ValueError(f"LoRA projection {proj!r} is unknown; expected names from {PROJECTIONS}")
        if set(ab) != {"a", "b"}:
            raise ValueError(f"lora['layers'][{proj!r}] must have keys 'a' and 'b'; got {sorted(ab)}")
        n, k = shapes[proj]
        a_shape, b_shape = tuple(ab["a"].shape), tuple(ab["b"].shape)
        r = a_shape[1] if len(a_shape) == 3 else -1
        want_a, want_b = (config.num_hidden_layers, r, k), (config.num_hidden_layers, n, r)
        if a_shape != want_a or b_shape != want_b:
            raise ValueError(
                f"lora['layers'][{proj!r}] has a {a_shape}, b {b_shape}; expected a [L, r, K] = {want_a} and "
                f"b [L, N, r] = {want_b}"
            )
        ranks.add(r)
    if len(ranks) != 1:
        raise ValueError(f"LoRA projections have different ranks {sorted(ranks)}; expected one rank")
    return ranks.pop()


def with_lora(
    frozen: dict[str, Any], lora: dict[str, Any] | None, trained_norms: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The model's params dict from the frozen {base, norms}, an adapter (None: no adapter) and the
    trained norm scales (None: the frozen ones)."""
    params = {"base": frozen["base"], "norms": merge_norms(frozen["norms"], trained_norms)}
    if lora is not None:
        params["lora"] = lora
    return params


def num_lora_params(lora: dict[str, Any]) -> int:
    """Number of trainable scalars in the adapter."""
    return sum(int(x.size) for x in jax.tree.leaves(lora))


# The RMSNorm scales trained beside LoRA (QeRL's `modules_to_save`); the final norm is not trained.
TRAINED_NORMS = ("input_layernorm", "post_attention_layernorm")


def init_trained_norms(norms: dict[str, Any]) -> dict[str, Any]:
    """Float32 masters of the trained scales, copied from the frozen norms: {"layers": {name: [L, D]}}."""
    return {"layers": {name: jnp.array(norms["layers"][name], jnp.float32, copy=True) for name in TRAINED_NORMS}}


def merge_norms(norms: dict[str, Any], trained: dict[str, Any] | None) -> dict[str, Any]:
    """The model's norms: the frozen ones with the trained per-layer scales in place (None: unchanged)."""
    if trained is None:
        return norms
    return {**norms, "layers": {**norms["layers"], **trained["layers"]}}


def check_trained_norms(trained: dict[str, Any], config: ModelConfig) -> None:
    """Validates the trained norms' structure and shapes against the model."""
    want = (config.num_hidden_layers, config.hidden_size)
    layers = trained.get("layers") if isinstance(trained, dict) else None
    if not isinstance(layers, dict) or sorted(layers) != sorted(TRAINED_NORMS):
        raise ValueError(f"trained norms must be {{'layers': {{name: [L, D]}}}} for name in {TRAINED_NORMS}")
    for name, w in layers.items():
        if tuple(w.shape) != want:
            raise ValueError(f"trained norms {name!r} have shape {tuple(w.shape)}; expected [L, D] = {want}")
