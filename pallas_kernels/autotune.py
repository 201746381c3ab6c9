"""Block sizes for the kernels: a small measured table (autotune.json) and a default rule.

Keys are "<kind>:<M bucket>:<N>:<K>" with kind "fwd" (y = x @ W.T) or "bwd" (dx = dy @ W)
and M bucket the smallest of M_BUCKETS that is >= M. A shape not in the table gets
`default_config`. The table is written by `benchmarks/kernels.py --sweep` on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

M_BUCKETS = (16, 32, 64, 256, 1024, 4096)
DECODE_MAX_M = 64  # M <= this: the memory-bound decode regime
BLOCK_MAX_M = 256  # nvfp4, M <= this: the block kernel ("block" mode, one M tile)
BLOCK_SWAP_FROM_M = 33  # from this M the block kernel needs swap=True (with x on the left Triton fails at M = 64)
NUM_SMS = 132  # H100 / H200 SXM
_TABLE_PATH = os.path.join(os.path.dirname(__file__), "autotune.json")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters of one kernel launch.

    bm: rows of x per program; bn: rows of W (output columns) per program; bk: K per step
    (fwd) or K columns of dx per program (bwd); bc: contraction step over N (bwd only);
    split_k: K ranges reduced afterwards (fwd, decode); swap: compute y.T = W @ x.T so
    that W is the dot's left operand (decode); group_m: program-order swizzle for L2;
    mode: "fused" (decode inside the matmul kernel), "block" (nvfp4, M <= BLOCK_MAX_M: the
    kernel that reads [bn, bk/16, 8] code blocks and decodes them with integer ops in the
    tensor-core operand layout; uses bm, bn, bk, split_k, swap, num_warps, num_stages) or
    "dequant" (a Pallas kernel writes W as bf16, then an XLA / cuBLAS dot; for large M,
    where the dot is compute-bound);
    scale_words: load the 1-byte block scales four to a 32-bit word (fwd, fused), so that
    Triton can pipeline them with cp.async like the codes (byte loads are issued
    synchronously inside the K loop). Measured on an H100: 0-15 % faster at decode
    (KERNEL_NOTES.md), so on by default in the decode regime.
    """

    bm: int
    bn: int
    bk: int
    bc: int = 64
    split_k: int = 1
    swap: bool = False
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    mode: str = "fused"
    scale_words: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def key(kind: str, m: int, n: int, k: int) -> str:
    return f"{kind}:{m_bucket(m)}:{n}:{k}"


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, dict]:
    if not os.path.exists(_TABLE_PATH):
        return {}
    with open(_TABLE_PATH) as f:
        data = json.load(f)
    return data.get("configs", {})


def default_config(kind: str, m: int, n: int, k: int, fmt: str = "nvfp4", block: bool = True) -> Config:
    """The rule for shapes not in the table (see KERNEL_NOTES.md for the reasoning).

    block=False: never the block kernel (for a table entry that does not apply to fmt / M).
    """
    bm = max(16, 1 << (max(1, m) - 1).bit_length())
    if kind == "fwd" and block and fmt == "nvfp4" and m <= DECODE_MAX_M:
        # Measured on an H100 (7B gate / down / q at M = 1 and 16): [64, 128] tiles, 4 warps,
        # 2-3 stages (more stages = fewer programs per SM = slower); ~2.5 programs per SM.
        bn, bk = 64, 128
        split = split_rule(n, k, bn, bk, min_programs=2.5 * NUM_SMS)
        swap = m >= BLOCK_SWAP_FROM_M
        return Config(bm=bm, bn=bn, bk=bk, split_k=split, swap=swap, num_warps=4, num_stages=3, mode="block")
    if kind == "fwd" and m <= DECODE_MAX_M:
        # Memory-bound: stream W tiles [64, 256]; split K when there are too few N tiles to
        # give every SM a program. x on the left (swap=False) won 10 of the 12 measured
        # decode shapes (autotune.json), W on the left the other two.
        bn = 64
        return Config(bm=bm, bn=bn, bk=256, split_k=split_rule(n, k, bn), num_warps=4, num_stages=4, scale_words=True)
    if kind == "fwd":
        # Above the decode regime the bf16 dequantize kernel + cuBLAS beat every fused tile
        # config measured on the H100 (M = 256: 3 of 4 Qwen2.5-7B shapes, the 4th a tie;
        # M = 4096: all; KERNEL_NOTES.md).
        return Config(bm=128, bn=128, bk=64, num_warps=8, num_stages=3, mode="dequant")
    # bwd: dx [M, K] = dy [M, N] @ W [N, K]; bk = K columns per program, bc = N step.
    if m <= DECODE_MAX_M:
        return Config(bm=bm, bn=0, bk=64, bc=128, num_warps=4, num_stages=4)
    return Config(bm=128, bn=0, bk=128, bc=64, num_warps=8, num_stages=3, mode="dequant")


def split_rule(n: int, k: int, bn: int, bk: int = 256, max_split: int = 16, min_programs: float = 0.8 * NUM_SMS) -> int:
    """Split-K factor for the decode kernels: the smallest divisor d of K / bk that gives
    at least min_programs programs (N tiles * d), at most max_split."""
    if k % bk:
        return 1
    steps, tiles = k // bk, pl_cdiv(n, bn)
    divisors = [d for d in range(1, min(steps, max_split) + 1) if steps % d == 0]
    for d in divisors:
        if tiles * d >= min_programs:
            return d
    return divisors[-1]


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def get_config(kind: str, m: int, n: int, k: int, fmt: str = "nvfp4") -> Config:
    """The table entry for (kind, M bucket, N, K), else `default_config`. The table is
    measured on nvfp4; a "block" entry does not apply to the other formats."""
    entry = _table().get(key(kind, m, n, k))
    if entry is not None and not (entry.get("mode") == "block" and (fmt != "nvfp4" or m > BLOCK_MAX_M)):
        return Config(**entry)
    return default_config(kind, m, n, k, fmt)
