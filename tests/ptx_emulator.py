"""A warp-wide emulator of the straight-line integer PTX the kernels and the probes inline (no GPU needed).

Every register holds one 32-bit value per lane; instructions run in order, each for all 32 lanes at once. It knows
what the decode and table PTX use: ``mov``, ``and``, ``or``, ``shl``, ``shr`` on b32/u32, ``prmt.b32`` (default
mode, with the sign-replicate bit), ``lop3.b32``, ``shfl.sync.idx.b32`` and ``cvt.rn.bf16x2.f32``; anything else
raises, so a test cannot pass on an instruction it skipped.
"""

from __future__ import annotations

import re
import struct

import torch

LANES = 32


def bf16_bits(value_bits: int) -> int:
    """The bf16 (round to nearest even, as a cast) of the fp32 with bits ``value_bits``."""
    value = struct.unpack("<f", struct.pack("<I", value_bits))[0]
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    source = a | (b << 32)
    out = 0
    for i in range(4):
        nibble = (sel >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        out |= (0xFF * (byte >> 7) if nibble & 8 else byte) << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:  # PTX's convention: a is 0xF0, b 0xCC, c 0xAA
    return sum(((lut >> (((a >> j) & 1) * 4 + ((b >> j) & 1) * 2 + ((c >> j) & 1))) & 1) << j for j in range(32))


def _shfl_source(lane: int, index: int, c: int) -> int:
    clamp, segment = c & 0x1F, (c >> 8) & 0x1F
    low = lane & segment
    high = low | (clamp & ~segment & 0x1F)
    source = low | (index & ~segment & 0x1F)
    return source if source <= high else lane


def run_ptx(asm: str, operands: dict[str, list[int]]) -> dict[str, list[int]]:
    """Runs ``asm`` (one ``{ ... }`` block of ``;``-separated instructions) with ``operands`` (``"$n"`` -> 32 lane
    values; outputs need no entry) and returns every register, operands included, as 32 lane values."""
    regs = {name: [v & 0xFFFFFFFF for v in values] for name, values in operands.items()}
    regs["%laneid"] = list(range(LANES))

    def lanes(x: str) -> list[int]:
        return regs[x] if x in regs else [int(x, 0) & 0xFFFFFFFF] * LANES

    body = asm.strip().removeprefix("{").removesuffix("}")
    for ins in (part.strip() for part in body.split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        args = [lanes(x) for x in a[1:]]
        if op == "prmt.b32":
            out = [_prmt(*v) for v in zip(*args)]
        elif op == "lop3.b32":
            out = [_lop3(*v) for v in zip(*args)]
        elif op == "shfl.sync.idx.b32":
            value, index, c = args[0], args[1], args[2]
            out = [value[_shfl_source(lane, index[lane], c[lane])] for lane in range(LANES)]
        elif op == "cvt.rn.bf16x2.f32":  # d = {cvt(a) high, cvt(b) low}
            out = [(bf16_bits(x) << 16) | bf16_bits(y) for x, y in zip(*args)]
        else:
            fn = {"mov.b32": lambda x: x, "mov.u32": lambda x: x, "and.b32": lambda x, y: x & y,
                  "or.b32": lambda x, y: x | y, "shl.b32": lambda x, y: x << y,
                  "shr.b32": lambda x, y: x >> y}.get(op)  # fmt: skip
            if fn is None:
                raise NotImplementedError(f"the PTX emulator does not know {op!r}")
            out = [fn(*v) for v in zip(*args)]
        if not re.fullmatch(r"\$?%?\w+", a[0]):
            raise ValueError(f"unexpected destination {a[0]!r}")
        regs[a[0]] = [v & 0xFFFFFFFF for v in out]
    return regs


def word_nibbles(word: int) -> list[int]:
    """The 8 nibbles of a packed 4-bit word in element order: element 2 i in the high nibble of byte i."""
    return [(word >> (8 * (j // 2) + 4 * (1 - j % 2))) & 0xF for j in range(8)]
