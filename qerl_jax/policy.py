"""The frozen policy a run samples from: loading, stop ids, backend."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import jax

from qerl_jax import compile_cache
from qerl_jax.errors import UserFacingError
from qerl_jax.model_dir import resolve_model_dir
from qerl_jax.model_io import load_cache
from qerl_jax.model_io.loader import CheckpointError
from qerl_jax.models.qwen2 import ModelConfig

if TYPE_CHECKING:
    from qerl_jax.run_config import RunConfig

# ----------------------------------------------------------------------------- set-up


def resolve_backend(name: str) -> str:
    """ "auto" -> the Pallas kernels on GPU, XLA dequant+dot elsewhere."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if name not in ("pallas", "xla"):
        raise UserFacingError(f"config.model.backend={name!r}; expected auto, pallas or xla")
    return name


def stop_token_ids(model_dir: str, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json, the tokenizer and ChatML's <|im_end|>."""
    ids = set(config.eos_token_id)
    gen_file = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_file):
        eos = json.load(open(gen_file)).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None and 0 <= i < config.vocab_size))


@dataclasses.dataclass
class Policy:
    """The frozen model and how it runs."""

    config: ModelConfig
    frozen: dict[str, Any]  # {"base", "norms"}; never updated
    tokenizer: Any
    backend: str
    quant: str
    stop_ids: tuple[int, ...]
    pad_id: int
    model_dir: str


def load_policy(cfg: RunConfig) -> Policy:
    model_dir = resolve_model_dir(cfg)
    quant = cfg.model.quant
    try:
        config, params, tokenizer = load_cache.load_or_convert(
            model_dir,
            dtype=cfg.model.dtype,
            quant=quant,
            quant_skip=tuple(cfg.model.quant_skip),
            root=compile_cache.cache_dir(cfg.model.cache_dir, load_cache.CACHE_NAME),
        )
    except CheckpointError as e:
        raise UserFacingError(str(e)) from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (config.pad_token_id or 0)
    return Policy(
        config=config,
        frozen=params,
        tokenizer=tokenizer,
        backend=resolve_backend(cfg.model.backend),
        quant=quant,
        stop_ids=stop_token_ids(model_dir, config, tokenizer),
        pad_id=int(pad_id),
        model_dir=model_dir,
    )


