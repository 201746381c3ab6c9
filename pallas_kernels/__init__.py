"""Pallas W4A16 matmul kernels for packed 4-bit weights (NVFP4, MXFP4, NF4).

Standalone: the kernels take arrays and a small format description (`KernelFormat`: block
size, code table, scale dtype); a packed weight is any object with `codes`, `scales`,
`global_scale` and `format` (e.g. `qerl_jax.quant.PackedWeight`).

`quant_matmul` & co. lower through Triton (any CUDA GPU; `interpret=True` on CPU).
`pallas_kernels.wgmma_nvfp4` is the Hopper-only NVFP4 decode kernel (Mosaic GPU) that the
rollout uses at small batch, on weights repacked with `wgmma_nvfp4.from_packed`.
`decode_attention` is the length-aware decode attention (Triton; reads only each row's cache
slots [start, end)); its jnp twin, the XLA path, is the model's
(`qerl_jax.models.qwen2.decode_attention_reference`).
"""

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.formats import KernelFormat
from pallas_kernels.quant_matmul import dequantize_bf16, nvfp4_matmul, quant_matmul

__all__ = [
    "KernelFormat",
    "decode_attention",
    "dequantize_bf16",
    "nvfp4_matmul",
    "quant_matmul",
]
