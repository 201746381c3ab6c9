"""LoRA pytrees <-> PEFT adapters (adapter_config.json + adapter_model.safetensors).

The adapter applies to the original (unquantized) base model with transformers/PEFT or vLLM.
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

from qerl_jax.loader import CheckpointError, hf_linear_name

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


def export_peft_adapter(
    lora: dict[str, Any],
    out_dir: str,
    *,
    rank: int,
    alpha: float,
    rslora: bool = False,
    base_model_name_or_path: str | None = None,
) -> str:
    """Writes `out_dir/adapter_config.json` and `out_dir/adapter_model.safetensors`; returns out_dir.

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
            lora, tmp, rank=rank, alpha=alpha, rslora=rslora, base_model_name_or_path=base_model_name_or_path
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


def _write_adapter(lora, out_dir: str, *, rank, alpha, rslora, base_model_name_or_path) -> None:
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
        "modules_to_save": None,
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(peft_state_dict(lora), os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


def load_peft_adapter(adapter_dir: str, num_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads a PEFT LoRA adapter -> (lora pytree with [L, ...] stacks, adapter_config dict)."""
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
    per_layer: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, array in load_file(weights_file).items():
        m = _PEFT_KEY.match(name)
        if m is None:
            raise CheckpointError(f"{weights_file}: unexpected tensor {name!r} (only LoRA A/B of linear projections)")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3).lower()
        per_layer.setdefault(proj, {"a": {}, "b": {}})[ab][layer] = array.astype(np.float32)
    layers = {}
    for proj, ab in per_layer.items():
        for part in ("a", "b"):
            if sorted(ab[part]) != list(range(num_layers)):
                raise CheckpointError(
                    f"{weights_file}: {proj} lora_{part.upper()} covers layers {sorted(ab[part])}, expected 0..{num_layers - 1}"
                )
        layers[proj] = {part: np.stack([ab[part][i] for i in range(num_layers)]) for part in ("a", "b")}
    return {"layers": layers}, config
