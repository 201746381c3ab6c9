"""LoRA pytrees <-> PEFT adapters (adapter_config.json + adapter_model.safetensors).

The adapter applies to the original (unquantized) base model with transformers/PEFT or vLLM.
Trained norm scales (`lora.TRAINED_NORMS`) are PEFT `modules_to_save`: whole replacement
weights, stored as `base_model.model.model.layers.<i>.<name>.weight` (the names PEFT's
save_pretrained writes and from_pretrained reads).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from qerl_jax.lora import TRAINED_NORMS
from qerl_jax.model_io.hf_layout import CheckpointError, hf_linear_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterWriteError(OSError):
    """The adapter could not be written (e.g. the disk is full); `out_dir` is as it was before."""


def peft_state_dict(lora: dict[str, Any]) -> dict[str, np.ndarray]:
    """lora["layers"][proj] {a [L, r, K], b [L, N, r]} -> PEFT tensor names (float32)."""
    tensors = {}
    for proj, ab in lora["layers"].items():
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        for layer in range(a.shape[0]):
            prefix = f"base_model.model.{hf_linear_name(layer, proj)}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer])
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer])
    return tensors


def peft_norms_state_dict(norms: dict[str, Any]) -> dict[str, np.ndarray]:
    """Trained norms {"layers": {name: [L, D]}} -> PEFT's modules_to_save tensor names (float32)."""
    tensors = {}
    for name, w in norms["layers"].items():
        w = np.asarray(w, np.float32)
        for layer in range(w.shape[0]):
            tensors[f"base_model.model.model.layers.{layer}.{name}.weight"] = np.ascontiguousarray(w[layer])
    return tensors


def export_peft_adapter(
    lora: dict[str, Any],
    out_dir: str,
    *,
    rank: int,
    alpha: float,
    rslora: bool = False,
    base_model_name_or_path: str | None = None,
    norms: dict[str, Any] | None = None,
) -> str:
    """Writes `out_dir/adapter_config.json` and `out_dir/adapter_model.safetensors`; returns out_dir.

    norms: trained norm scales {"layers": {name: [L, D]}} saved as modules_to_save (None: none).
    Atomic: both files are written to a temporary folder beside `out_dir`, renamed into place when
    complete; on a failure (AdapterWriteError) `out_dir` is left as it was.
    """
    if not lora or not lora.get("layers"):
        raise ValueError("cannot export an empty LoRA pytree (no targeted projections)")
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
        _write_adapter(
            lora, norms, tmp, rank=rank, alpha=alpha, rslora=rslora, base_model_name_or_path=base_model_name_or_path
        )
        if os.path.isdir(out_dir):  # an earlier export: replaced whole
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old.", dir=parent)
            os.replace(out_dir, os.path.join(old, "adapter"))
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except (OSError, SafetensorError) as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise AdapterWriteError(f"could not write the PEFT adapter to {out_dir}: {e}") from e
    return out_dir


def _write_adapter(lora, norms, out_dir: str, *, rank, alpha, rslora, base_model_name_or_path) -> None:
    targets = sorted(lora["layers"])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "use_rslora": bool(rslora),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None if norms is None else sorted(norms["layers"]),
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    tensors = peft_state_dict(lora) | ({} if norms is None else peft_norms_state_dict(norms))
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
_NORM_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(%s)\.weight$" % "|".join(TRAINED_NORMS))


def load_peft_adapter(adapter_dir: str, num_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a PEFT LoRA adapter -> (lora pytree with [L, ...] stacks, adapter_config dict).

    Trained norm scales (modules_to_save) are read by `load_peft_norms`.
    """
    config, tensors, weights_file = _read_adapter(adapter_dir)
    per_layer: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, array in tensors.items():
        m = _PEFT_KEY.match(name)
        if m is None:
            if _NORM_KEY.match(name):
                continue
            raise CheckpointError(
                f"{weights_file}: unexpected tensor {name!r} (only LoRA A/B of linear projections and the "
                f"{TRAINED_NORMS} scales)"
            )
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3).lower()
        per_layer.setdefault(proj, {"a": {}, "b": {}})[ab][layer] = array.astype(np.float32)
    layers = {}
    for proj, ab in per_layer.items():
        for part in ("a", "b"):
            if sorted(ab[part]) != list(range(num_layers)):
                raise CheckpointError(
                    f"{weights_file}: {proj} lora_{part.upper()} covers layers {sorted(ab[part])}, but the model "
                    f"has {num_layers} (0..{num_layers - 1}): an adapter of another model?"
                )
        layers[proj] = {part: np.stack([ab[part][i] for i in range(num_layers)]) for part in ("a", "b")}
    return {"layers": layers}, config


def load_peft_norms(adapter_dir: str, num_layers: int) -> dict[str, Any] | None:
    """The trained norm scales {"layers": {name: [L, D] float32}} of a PEFT adapter, or None if it has none."""
    config, tensors, weights_file = _read_adapter(adapter_dir)
    saved = config.get("modules_to_save") or []
    if not saved:
        return None
    if sorted(saved) != sorted(TRAINED_NORMS):
        raise CheckpointError(
            f"{os.path.join(adapter_dir, ADAPTER_CONFIG)}: modules_to_save {saved} is not supported; expected "
            f"{list(TRAINED_NORMS)}"
        )
    per_norm: dict[str, dict[int, np.ndarray]] = {name: {} for name in TRAINED_NORMS}
    for name, array in tensors.items():
        m = _NORM_KEY.match(name)
        if m is not None:
            per_norm[m.group(2)][int(m.group(1))] = array.astype(np.float32)
    for name, by_layer in per_norm.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise CheckpointError(
                f"{weights_file}: {name} (modules_to_save) covers layers {sorted(by_layer)}, "
                f"expected 0..{num_layers - 1}"
            )
    return {"layers": {name: np.stack([w[i] for i in range(num_layers)]) for name, w in per_norm.items()}}


def _read_adapter(adapter_dir: str) -> tuple[dict[str, Any], dict[str, np.ndarray], str]:
    """(adapter_config, tensors, weights file) of a PEFT LoRA adapter directory."""
    cfg_file = os.path.join(adapter_dir, ADAPTER_CONFIG)
    weights_file = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    for f in (cfg_file, weights_file):
        if not os.path.isfile(f):
            raise CheckpointError(
                f"{f} is missing: a PEFT adapter directory needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
            )
    with open(cfg_file) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type {config.get('peft_type')!r} is not supported; expected 'LORA'")
    return config, load_file(weights_file), weights_file
