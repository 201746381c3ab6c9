"""PTX for decoding packed 4-bit codes to scaled bf16, plus a numpy model of that PTX.

One asm instance (Triton `inline_asm_elementwise`, pack=4) takes four code bytes (one
32-bit register) and, per byte, its block scale as a bf16 pair (s, s); it returns per
byte b one 32-bit word holding the bf16 pair

    low half:  bf16(table[b & 0xF] * s)     (element k = 2j, low nibble)
    high half: bf16(table[b >> 4]  * s)     (element k = 2j + 1, high nibble)

(one output per byte because Pallas lowers single-result inline asm only). The table is
applied with byte permutes (`prmt`): the low and high bytes of the 16 bf16 entries sit in
8-byte lookup registers, `prmt` looks up four nibbles at a time, and a per-nibble byte
mask from bit 3 (prmt's sign-replicate mode) picks entries 8..15 (`lop3`); for E2M1, whose
upper half is the lower half negated, the mask just sets the sign bit. The scale is
applied by `fma.rn.bf16x2` with a -0 addend: the exact product rounded once to bf16
(exact for nvfp4 / mxfp4, whose scales and codes have few significant bits).

Everything is elementwise per byte, so the result does not depend on which four bytes
Triton groups into one register. `emulate` runs the same instruction list on numpy
arrays; tests check it against the table for all 256 byte values.
"""

from __future__ import annotations

import numpy as np


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bf16 bit patterns (round to nearest even)."""
    u = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _table_words(table: np.ndarray) -> dict[str, int]:
    """The eight 32-bit lookup registers: {H,L}{P,N}{0,1} = {high,low} bytes of entries
    {0..7, 8..15}, four entries per register, entry i in byte i % 4."""
    bits = bf16_bits(table).astype(np.uint32)
    assert bits.shape == (16,)
    hi, lo = bits >> 8, bits & 0xFF
    words = {}
    for name, src in (("H", hi), ("L", lo)):
        for half, off in (("P", 0), ("N", 8)):
            for r in range(2):
                b = src[off + 4 * r : off + 4 * r + 4]
                words[f"{name}{half}{r}"] = int(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))
    return words


def _is_sign_symmetric(table: np.ndarray) -> bool:
    """True when entry i + 8 is entry i with the sign bit set (E2M1)."""
    bits = bf16_bits(table).astype(np.uint32)
    return bool(np.all(bits[8:] == (bits[:8] | 0x8000)))


def table_words(table: np.ndarray) -> list[int]:
    """The lookup words the program uses, in operand order (see `program`)."""
    w = _table_words(table)
    names = ("HP0", "HP1", "LP0", "LP1") if _is_sign_symmetric(table) else tuple(w)
    return [w[k] for k in names]


def program(table: np.ndarray, words_as_operands: bool = False) -> list[tuple]:
    """The instruction list: (op, dst, *srcs).

    Operands: $0..$3 outputs, one 32-bit (even, odd) bf16 pair per code byte b0..b3;
    $4 the four code bytes; $5..$8 the four scales, each as a bf16 pair (s, s).
    Integers are immediates. The lookup words are immediates, or with
    `words_as_operands` the operands $9, $13, $17, ... (one int32 tensor operand each,
    four registers per operand at pack=4): values the kernel loads from memory, which
    ptxas keeps in registers instead of re-materialising them before every use.
    """
    w = _table_words(table)
    symmetric = _is_sign_symmetric(table)
    names = ("HP0", "HP1", "LP0", "LP1") if symmetric else tuple(w)
    if words_as_operands:
        ins: list[tuple] = [("mov", k.lower(), f"${9 + 4 * j}") for j, k in enumerate(names)]
    else:
        ins = [("mov", k.lower(), w[k]) for k in names]
    ins.append(("mov", "negz", 0x80008000))  # bf16x2 (-0, -0), the fma addend
    if symmetric:
        ins.append(("mov", "sgn", 0x80808080))
    ins += [
        # 3-bit selectors: prmt reads the low 16 bits, nibbles [b0.lo, b0.hi, b1.lo, b1.hi]
        ("and", "sa", "$4", 0x77777777),
        ("shr", "sb", "sa", 16),  # [b2.lo, b2.hi, b3.lo, b3.hi]
        ("shl", "c4", "$4", 4),
        # 0xFF/0x00 per nibble from its bit 3, by prmt's sign-replicate mode applied to
        # the byte (of $4 or $4 << 4) whose msb is that bit.
        ("prmt", "ma", "c4", "$4", 0xD9C8),
        ("prmt", "mb", "c4", "$4", 0xFBEA),
    ]
    for g in ("a", "b"):
        if symmetric:  # entries 8..15 = entries 0..7 with the sign bit set
            ins += [
                ("prmt", f"hp{g}", "hp0", "hp1", f"s{g}"),
                ("lop3", f"h{g}", f"hp{g}", f"m{g}", "sgn", 0xF8),  # hp | (m & 0x80)
                ("prmt", f"l{g}", "lp0", "lp1", f"s{g}"),
            ]
        else:
            for byte in ("h", "l"):
                ins += [
                    ("prmt", f"{byte}p{g}", f"{byte}p0", f"{byte}p1", f"s{g}"),
                    ("prmt", f"{byte}n{g}", f"{byte}n0", f"{byte}n1", f"s{g}"),
                    ("lop3", f"{byte}{g}", f"m{g}", f"{byte}n{g}", f"{byte}p{g}", 0xCA),  # m ? n : p
                ]
    ins += [
        # (even, odd) bf16 pair of each byte: low/high bytes of nibbles 2j and 2j + 1.
        ("prmt", "p0", "la", "ha", 0x5140),
        ("prmt", "p1", "la", "ha", 0x7362),
        ("prmt", "p2", "lb", "hb", 0x5140),
        ("prmt", "p3", "lb", "hb", 0x7362),
        ("mulbf16x2", "$0", "p0", "$5"),
        ("mulbf16x2", "$1", "p1", "$6"),
        ("mulbf16x2", "$2", "p2", "$7"),
        ("mulbf16x2", "$3", "p3", "$8"),
    ]
    return ins


def _operand(v) -> str:
    if isinstance(v, int):
        return f"0x{v:08X}" if v > 0xFFFF else f"0x{v:X}"
    return v if v.startswith("$") else f"%{v}"


def ptx(table: np.ndarray, words_as_operands: bool = False) -> str:
    """The asm string for `elementwise_inline_asm` (constraints: `constraints`)."""
    ins = program(table, words_as_operands)
    regs = sorted({i[1] for i in ins if not i[1].startswith("$")})
    lines = ["{", ".reg .b32 " + ", ".join(f"%{r}" for r in regs) + ";"]
    for op, dst, *src in ins:
        d = _operand(dst)
        s = [_operand(v) for v in src]
        if op == "mov":
            lines.append(f"mov.b32 {d}, {s[0]};")
        elif op in ("and", "shl"):
            lines.append(f"{op}.b32 {d}, {s[0]}, {s[1]};")
        elif op == "shr":
            lines.append(f"shr.u32 {d}, {s[0]}, {s[1]};")
        elif op == "prmt":
            lines.append(f"prmt.b32 {d}, {s[0]}, {s[1]}, {s[2]};")
        elif op == "lop3":
            lines.append(f"lop3.b32 {d}, {s[0]}, {s[1]}, {s[2]}, {s[3]};")
        elif op == "mulbf16x2":
            # fma with a -0.0 addend: a*b rounded once; -0 keeps the sign of 0 products.
            lines.append(f"fma.rn.bf16x2 {d}, {s[0]}, {s[1]}, %negz;")
        else:  # pragma: no cover
            raise AssertionError(op)
    lines.append("}")
    return "\n".join(lines)


CONSTRAINTS = "=r,=r,=r,=r,r,r,r,r,r"


def constraints(table: np.ndarray, words_as_operands: bool = False) -> str:
    extra = ",r,r,r,r" * len(table_words(table)) if words_as_operands else ""
    return CONSTRAINTS + extra


# ----------------------------------------------------------------------------- emulation


def _prmt(a: np.ndarray, b: np.ndarray, sel) -> np.ndarray:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    sel = np.asarray(sel, np.uint64)
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = np.zeros_like(out)
        for j in range(8):
            byte = np.where((nib & 7) == j, pool[j], byte)
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0x00), byte)
        out |= byte.astype(np.uint64) << (8 * i)
    return out


def _lop3(a, b, c, lut: int) -> np.ndarray:
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
    for bit in range(32):
        ia, ib, ic = (a >> bit) & 1, (b >> bit) & 1, (c >> bit) & 1
        idx = (ia << 2) | (ib << 1) | ic  # lop3 truth-table index: a=0xF0, b=0xCC, c=0xAA
        out |= ((np.uint64(lut) >> idx) & 1) << bit
    return out


def _mul_bf16x2(a, b) -> np.ndarray:
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for half in range(2):
        x = bf16_to_f32(((a >> (16 * half)) & 0xFFFF).astype(np.uint32))
        y = bf16_to_f32(((b >> (16 * half)) & 0xFFFF).astype(np.uint32))
        p = bf16_bits(x.astype(np.float32) * y.astype(np.float32)).astype(np.uint64)
        out |= p << (16 * half)
    return out


def emulate(table: np.ndarray, codes_u8: np.ndarray, scales_bf16_bits: np.ndarray, words_as_operands: bool = False):
    """Run `program(table)` on numpy arrays.

    codes_u8: uint8 [..., 4j] (groups of four bytes); scales_bf16_bits: uint16, same
    shape. Returns (even, odd) uint16 bf16 bit patterns of that shape.
    """
    c = np.asarray(codes_u8, np.uint8).reshape(-1, 4).astype(np.uint64)
    s = np.asarray(scales_bf16_bits, np.uint16).reshape(-1, 4).astype(np.uint64)
    regs: dict[str, np.ndarray] = {"$4": c[:, 0] | (c[:, 1] << 8) | (c[:, 2] << 16) | (c[:, 3] << 24)}
    for j in range(4):
        regs[f"${5 + j}"] = s[:, j] | (s[:, j] << 16)
    for j, word in enumerate(table_words(table)):
        regs[f"${9 + 4 * j}"] = np.full(c[:, 0].shape, word, np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)

    def val(v):
        return np.uint64(v) if isinstance(v, int) else regs[v]

    for op, dst, *src in program(table, words_as_operands):
        v = [val(x) for x in src]
        if op == "mov":
            r = v[0]
        elif op == "and":
            r = v[0] & v[1]
        elif op == "shr":
            r = v[0] >> v[1]
        elif op == "shl":
            r = (v[0] << v[1]) & mask32
        elif op == "prmt":
            r = _prmt(v[0], v[1], v[2])
        elif op == "lop3":
            r = _lop3(v[0], v[1], v[2], src[3])
        elif op == "mulbf16x2":
            r = _mul_bf16x2(v[0], v[1])
        else:  # pragma: no cover
            raise AssertionError(op)
        regs[dst] = np.broadcast_to(np.asarray(r, np.uint64) & mask32, c[:, 0].shape).copy()

    pairs = np.stack([regs[f"${j}"] for j in range(4)], -1)
    shape = np.shape(codes_u8)
    even = (pairs & 0xFFFF).astype(np.uint16).reshape(shape)
    odd = (pairs >> 16).astype(np.uint16).reshape(shape)
    return even, odd
