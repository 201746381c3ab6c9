"""The one registry of the packed 4-bit formats: a `Format` record per format.

Every per-format fact (block size, code table, scale encoding, compressed-tensors name) is
read from here. The config spelling of "no quantization" is `DENSE` ("bf16"); it is a config
value, not a `Format`.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

DENSE = "bf16"

# E2M1: bit 3 is the sign, bits 0..2 index the magnitude.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

# The 16 NormalFloat levels of QLoRA (bitsandbytes' NF4 table), in code order.
NF4_VALUES = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)


@dataclasses.dataclass(frozen=True)
class Format:
    """A packed 4-bit format (see `qerl_jax.quant.packed` for the layout).

    Its first four fields are the format description `pallas_kernels` takes (`KernelFormat`).
    """

    name: str
    block_size: int  # consecutive elements along K sharing one scale
    code_table: tuple[float, ...]  # the 16 values of the 4-bit codes, float32-exact
    scale_dtype: np.dtype  # the dtype of `PackedWeight.scales`
    ct_name: str | None = None  # compressed-tensors' "format" (None: not writable as one)

    @property
    def scale_bytes(self) -> int:
        return self.scale_dtype.itemsize


NVFP4 = Format("nvfp4", 16, tuple(map(float, E2M1_VALUES)), np.dtype(ml_dtypes.float8_e4m3fn), "nvfp4-pack-quantized")
MXFP4 = Format("mxfp4", 32, tuple(map(float, E2M1_VALUES)), np.dtype(np.uint8), "mxfp4-pack-quantized")  # E8M0
NF4 = Format("nf4", 64, tuple(map(float, NF4_VALUES)), np.dtype(np.float32))  # absmax

REGISTRY: dict[str, Format] = {f.name: f for f in (NVFP4, MXFP4, NF4)}
FORMATS = tuple(REGISTRY)  # the format names
CONFIG_FORMATS = (DENSE, *FORMATS)  # the values of the config's model.quant
CT_FORMATS = tuple(name for name, f in REGISTRY.items() if f.ct_name)  # writable as compressed-tensors


def get(name: str) -> Format:
    """The `Format` named `name`; ValueError naming the choices otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown packed format {name!r}; expected one of {FORMATS}") from None
