"""The frozen policy a run samples from: checkpoint resolution, loading, stop ids, backend."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import ml_collections
import optax

from qerl_jax import aqn, lora, optim, tiny
from qerl_jax.loader import CheckpointError, load_model, load_tokenizer
from qerl_jax.models.qwen2 import ModelConfig
from qerl_jax.rollout.sampling import SamplingConfig


class UserFacingError(RuntimeError):
    """A problem the user can fix (bad path, out of memory, ...): printed without a traceback."""

    exit_code = 1  # the commands' exit status for it


# ----------------------------------------------------------------------------- set-up


def resolve_backend(name: str) -> str:
    """ "auto" -> the Pallas kernels on GPU, XLA dequant+dot elsewhere."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if name not in ("pallas", "xla"):
        raise UserFacingError(f"config.model.backend={name!r}; expected auto, pallas or xla")
    return name


def tiny_model_dir(cfg: ml_collections.ConfigDict) -> str:
    """Where model.tiny builds its random checkpoint."""
    return os.path.join(cfg.workdir, "tiny_model")


# What a run reads of a hub checkpoint: weights, configs, tokenizer files.
HUB_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face hub model id ("org/name") rather than a local path."""
    return bool(_HUB_ID.fullmatch(path)) and not os.path.exists(path) and not path.endswith(".gguf")


def _hub_offline() -> bool:
    import huggingface_hub  # noqa: PLC0415

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return env or huggingface_hub.constants.HF_HUB_OFFLINE


def hub_snapshot(repo_id: str, *, download: bool = True) -> str | None:
    """The local snapshot directory of hub model `repo_id` (HUB_PATTERNS files only, in the hub's cache).

    Downloads what is missing unless offline (HF_HUB_OFFLINE) or `download` is False; then only the
    cache is read, and None is returned for an id that is not cached while online and not downloading.
    Raises UserFacingError (one line) when the id cannot be had.
    """
    import huggingface_hub  # noqa: PLC0415
    from huggingface_hub import errors  # noqa: PLC0415

    offline = _hub_offline()
    cache_dir = os.environ.get("HF_HUB_CACHE") or None  # read per call (the hub reads it once, at import)
    try:
        return huggingface_hub.snapshot_download(
            repo_id, allow_patterns=list(HUB_PATTERNS), cache_dir=cache_dir, local_files_only=offline or not download
        )
    except errors.LocalEntryNotFoundError:
        if not offline:
            return None
        raise UserFacingError(
            f"model.path {repo_id!r} is a hub id, but HF_HUB_OFFLINE is set and it is not in the hub's cache "
            f"({cache_dir or huggingface_hub.constants.HF_HUB_CACHE}): download it where there is network "
            f"(`huggingface-cli download {repo_id} --local-dir DIR`) and pass --config.model.path=DIR"
        ) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
        raise UserFacingError(
            f"model.path {repo_id!r} is neither a local path nor a model on the Hugging Face hub "
            f"({type(e).__name__}); pass a local checkpoint directory"
        ) from None
    except (OSError, errors.HfHubHTTPError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserFacingError(
            f"model.path {repo_id!r}: cannot download it from the Hugging Face hub ({first}); with no network, "
            "pass a local checkpoint directory as --config.model.path"
        ) from None


def resolve_model_dir(cfg: ml_collections.ConfigDict, *, download: bool = True) -> str | None:
    """The local checkpoint directory (or GGUF file); with model.tiny, a random tiny model built on first use.

    A hub id ("Qwen/Qwen2.5-7B-Instruct", not an existing path) resolves through the hub's cache,
    downloading when online (`hub_snapshot`); with download=False an id not cached yet gives None.
    """
    if cfg.model.tiny:
        return tiny.build_tiny_checkpoint(tiny_model_dir(cfg))
    path = cfg.model.path
    if path and os.path.isfile(path) and not path.endswith(".gguf"):
        raise UserFacingError(
            f"model path {path!r} is a file; expected a checkpoint directory (config.json + safetensors) or a "
            ".gguf file"
        )
    if path and is_hub_id(path):
        return hub_snapshot(path, download=download)
    if not path or not (os.path.isdir(path) or path.endswith(".gguf") and os.path.isfile(path)):
        raise UserFacingError(
            f"model path {path!r} does not exist: pass a local checkpoint directory, a .gguf file or a hub id "
            "(e.g. --config.model.path=Qwen/Qwen2.5-7B-Instruct, downloaded to the hub's cache when online), "
            "or try --config=configs/tiny.py for the offline demo."
        )
    return path


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


def load_policy(cfg: ml_collections.ConfigDict) -> Policy:
    model_dir = resolve_model_dir(cfg)
    quant = cfg.model.quant
    try:
        config, params = load_model(
            model_dir,
            dtype=cfg.model.dtype,
            quant=quant,
            quant_skip=tuple(cfg.model.quant_skip),
        )
        tokenizer = load_tokenizer(model_dir)
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


def lora_config(cfg) -> lora.LoraConfig:
    return lora.LoraConfig(
        rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets), rslora=cfg.lora.rslora
    )


def aqn_config(cfg, quant: str) -> aqn.AQNConfig:
    enabled = aqn.default_aqn_enabled(quant) if cfg.aqn.enabled is None else bool(cfg.aqn.enabled)
    return aqn.AQNConfig(
        enabled=enabled,
        sigma_start=cfg.aqn.sigma_start,
        sigma_end=cfg.aqn.sigma_end,
        num_stages=cfg.aqn.num_stages,
        decay=cfg.aqn.decay,
        total_steps=cfg.train.total_steps,
    )


def sampling_config(cfg, policy: Policy) -> SamplingConfig:
    return SamplingConfig(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_ids=policy.stop_ids,
        pad_id=policy.pad_id,
    )


def optimizer_from_config(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warm-up + cosine/constant schedule and grad clipping; also the lr schedule."""
    total = cfg.train.total_steps
    warmup = int(round(cfg.optim.warmup_frac * total))
    optimizer = optim.make_optimizer(
        cfg.optim.lr,
        warmup_steps=warmup,
        total_steps=total,
        schedule=cfg.optim.schedule,
        b1=cfg.optim.b1,
        b2=cfg.optim.b2,
        weight_decay=cfg.optim.weight_decay,
        clip_norm=cfg.optim.clip_norm,
    )
    return optimizer, optim.make_schedule(
        cfg.optim.lr, warmup_steps=warmup, total_steps=total, schedule=cfg.optim.schedule
    )
