"""The paper's comparison, one flag apart: precision and AQN on/off on the GSM8K recipe.

  python -m qerl_jax.main --config=configs/baselines.py:nvfp4_aqn
  python -m qerl_jax.main --config=configs/baselines.py:bf16      (bf16 LoRA, lr 5e-6 as in the paper)
Variants: bf16, nf4, mxfp4, nvfp4, nf4_aqn, mxfp4_aqn, nvfp4_aqn.
"""

import importlib.util
import os

from qerl_jax.quant.formats import DENSE, FORMATS

_spec = importlib.util.spec_from_file_location("gsm8k_config", os.path.join(os.path.dirname(__file__), "gsm8k.py"))
_gsm8k = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gsm8k)


def get_config(variant: str = "nvfp4_aqn"):
    quant, _, aqn = variant.partition("_")
    if quant not in (DENSE, *FORMATS) or aqn not in ("", "aqn") or (quant == DENSE and aqn):
        raise ValueError(f"unknown baseline {variant!r}; expected {DENSE} or <{'|'.join(FORMATS)}>[_aqn]")
    c = _gsm8k.get_config()
    c.workdir = f"runs/baseline_{variant}"
    c.model.quant = quant
    c.aqn.enabled = aqn == "aqn"
    if quant == DENSE:
        c.optim.lr = 5e-6
    return c
