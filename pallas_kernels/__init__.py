"""Pallas (Triton) W4A16 matmul kernels for packed 4-bit weights (NVFP4, MXFP4, NF4)."""

from pallas_kernels.quant_matmul import dequantize_bf16, nvfp4_matmul, quant_matmul, quant_matmul_dx

__all__ = ["dequantize_bf16", "nvfp4_matmul", "quant_matmul", "quant_matmul_dx"]
