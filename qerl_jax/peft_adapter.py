"""Export a trained LoRA pytree as a PEFT adapter (adapter_config.json + adapter_model.safetensors).

The adapter applies to the original (unquantized) base model with transformers/PEFT or vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from qerl_jax.loader import hf_linear_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


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
    """Writes `out_dir/adapter_config.json` and `out_dir/adapter_model.safetensors`; returns out_dir."""
    if not lora or not lora.get("layers"):
        raise ValueError("cannot export an empty LoRA pytree (no targeted projections)")
    os.makedirs(out_dir, exist_ok=True)
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
    return out_dir
