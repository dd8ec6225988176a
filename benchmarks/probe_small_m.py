"""Where the small-M kernel's time goes at M = 1: stripped-down GEMV kernels that each add one cost, timed like
``tune_small_m.py`` (CUDA graph, weight copies that overflow the L2), next to the production kernel.

Kernels (M = 1, bf16 x, fp32 output, no LoRA, no bias; split-K by fp32 atomics, which the production kernel cannot
use because they are not deterministic):

  stream     reads the packed weight as 32-bit words and the absmax codes, sums a bit of each: the memory system's
             rate for this access pattern (the upper bound of any decode on top of it)
  arith      stream + nibble extraction + a linear "code" (no lookup) + the scale decode + FMAs with x: everything
             but the code-table lookup
  lut        arith with the real code-table lookup (a gather per weight): the complete, correct nf4 GEMV
  shfl       lut with the table in registers: lane L of each half-warp holds code[L % 16] and a warp shuffle
             fetches entry q (the shuffle's 16-lane segments take q modulo 16, so the nibble needs no mask)
  bits       shfl without the lookup: the shifted word's bits taken as the fp32 "code" (wrong values): what the
             shift / FMA / reduction structure costs on its own
  tcshfl     tensor cores at M = 1: the shuffle lookup times the scale, rounded to bf16, then ``tl.dot`` of the
             (BLOCK_N, BLOCK_K) tile with x as the first of 16 columns (the reference's numerics)
  tcbits     tcshfl without the lookup and the scale (the word's bits as bf16, wrong values): the tensor-core
             structure's own cost
  tcbd       tensor cores with the scales factored out: bf16 codes by shuffle, ``tl.dot`` with a block-diagonal x
             (column b holds x over absmax block b of the tile), so each block's sum comes out of the MMA and is
             scaled once in fp32 (codes rounded to bf16, no per-weight multiply or conversion)
  shflacc    shfl keeping (BLOCK_N, blocks) partial sums across the loop, reduced across threads once at the end
             (shfl reduces each tile's sums to (BLOCK_N,), cross-thread, every iteration)
  shflacc3   shflacc with (BLOCK_N, blocks, words) partial sums: each word's 8 products and its scale in-thread
  tcprmt     tensor cores, no shuffles: each word decoded to 8 bf16 codes by byte permutes (``prmt``) from the
             code table held in registers (low and high bytes of the 16 bf16 codes, 4 registers each; a nibble's
             bit 3 picks the table half), one absmax block (64 K) per ``tl.dot``, scaled in fp32 after the MMA.
             Reported wrong on Triton 3.6: the decode needs a word's 8 elements in one thread (pack=8), and the
             layout Triton gives it (the MMA operand's) spreads them over 4 lanes
  tcprmtb    tcprmt with W as the MMA's second operand and K permuted per 64-wide block so that a thread's operand
             registers hold whole words (see the kernel's docstring). Also wrong on Triton 3.6 (docs/kernels.md)
  tcprmtc    tcprmtb with the decode as one word in, four bf16 pairs out (no pack), the pairs split in-thread by
             truncation and tl.join; Triton 3.6 moves the decoded tile to the MMA through shared memory (not timed)
  cuprmt     shfl with tcprmt's byte-permute decode instead of the shuffles: each word decoded in its thread to four
             bf16 pairs, each pair widened to two fp32 values by a shift (even element) and a mask (odd element),
             FMAs with x, no warp shuffle for the lookup (codes rounded to bf16)
  cuprmt2    cuprmt without the mask: the whole pair read as the odd element (the even element's bits become extra
             low mantissa bits, up to a bf16 ulp off): what the mask costs
  cuh2       cuprmt with packed 16-bit math: each word's four bf16 code pairs times its four x pairs (read as
             32-bit words) by ``fma.rn.bf16x2`` (two products per instruction, each half summing 4 products in bf16),
             the two halves widened to fp32 once per word; codes and per-word partial sums rounded to bf16
  cuh2h      cuh2 in fp16: the code table in fp16, each x pair converted to fp16 in the kernel, ``fma.rn.f16x2``,
             the halves added in fp16 and widened once per word (fp16's 11-bit mantissa: 8x finer sums than
             bf16's; x beyond fp16's range would overflow, which a production kernel would have to scale away)
  cuh2r      cuh2 with the code table's 8 permute words (and one mask constant) loaded from memory once per
             program and passed to the decode as operands: written as immediates, ptxas copies a table word from a
             uniform register before each permute that reads it
  cuh2hr     cuh2h with the table as operands, as cuh2r
  cuh2s      cuh2r with each half-word's table half chosen by a bit select (``lop3``) under a byte mask that one
             sign-replicating permute makes from the nibbles' top bits (no mask constant): 22 instructions a word
  int8       int8 weights as 32-bit words, sign-extended bytes, FMAs, row scale

The ``lut`` kernel is checked against the reference before it is timed. Results: ``probe_small_m.csv`` in --out.

    python benchmarks/probe_small_m.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import _common as C
import torch
import triton
import triton.language as tl

from peft_fastlora.ops.kernels.jit import INV_127, decode_absmax
from peft_fastlora.ops.kernels.small_m_kernel import PACKED_DOT_PTX, PERMUTE_DECODE_PTX

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096)]  # (N, K)
MODES = {"stream": 0, "arith": 1, "lut": 2, "shfl": 3, "bits": 4, "tcshfl": 5, "tcbits": 6, "tcbd": 7, "shflacc": 8,
         "shflacc3": 9, "tcprmt": 10, "tcprmtb": 11, "tcprmtc": 12, "cuprmt": 13, "cuprmt2": 14,
         "cuh2": 15, "cuh2h": 16, "cuh2r": 17, "cuh2hr": 18, "cuh2s": 19}
TC_MODES = ("tcshfl", "tcbits", "tcbd", "tcprmt", "tcprmtb", "tcprmtc")
# variants whose outputs are right (checked before timing)
CHECKED = ("lut", "shfl", "tcshfl", "tcbd", "tcprmt", "shflacc", "shflacc3", "cuprmt", "cuh2", "cuh2h", "cuh2r",
           "cuh2hr", "cuh2s", "int8")
# checked variants whose codes or weights are rounded to bf16: 1e-2 of the largest output, the others 1e-3
BF16_CHECKED = TC_MODES + ("cuprmt", "cuh2", "cuh2h", "cuh2r", "cuh2hr", "cuh2s")
FP16_MODES = ("cuh2h", "cuh2hr")
TABLE_OPERAND_MODES = ("cuh2r", "cuh2hr", "cuh2s")
DEFAULT_VARIANTS = ("stream", "lut", "shfl")
# (BLOCK_N, BLOCK_K, num_warps)
TILES_4BIT = [(4, 512, 1), (8, 256, 1), (8, 512, 2), (16, 256, 2), (16, 512, 4), (8, 1024, 4), (32, 256, 4),
              (4, 1024, 2), (16, 128, 1), (2, 1024, 1), (4, 1024, 1), (8, 512, 1), (2, 2048, 2), (4, 2048, 2),
              (16, 512, 2), (8, 1024, 2)]  # fmt: skip
TILES_INT8 = [(4, 256, 1), (8, 256, 2), (8, 512, 4), (16, 256, 4), (4, 512, 2), (16, 128, 2)]
# tensor-core variants: BLOCK_N >= 16 (the MMA's 16-row side)
TILES_TC = [(16, 256, 1), (32, 256, 2), (64, 128, 4), (64, 256, 4), (128, 128, 4), (128, 256, 4)]
SPLITS = (1, 2, 4, 8, 16)


@triton.jit
def _program_rows(N, words_per_split, n_words, BLOCK_N: tl.constexpr):
    """This program's output features (offsets, mask, int64 rows) and its K range in words, ``[w_start, w_end)``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_start = tl.program_id(1) * words_per_split
    return offs_n, offs_n < N, offs_n.to(tl.int64), w_start, tl.minimum(w_start + words_per_split, n_words)


@triton.jit
def _probe_4bit(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64  # absmax blocks (of 8 words) per tile
    j = tl.arange(0, 8)
    shifts = (j // 2) * 8 + (1 - j % 2) * 4  # element j of a little-endian word: even elements in high nibbles
    word_in_tile = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8)
    x_in_tile = word_in_tile[:, :, None] * 8 + j[None, None, :]  # (NB, 8, 8)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, NB, 8), dtype=tl.float32)
    if MODE == 3 or MODE == 4 or MODE == 8 or MODE == 9:  # this lane's table entry, code[lane % 16]
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((1,), tl.int32)], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
        entry = tl.reshape(tl.load(code_ptr + (lane & 15)).to(tl.int32, bitcast=True), (1, 1, 1, 1))
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        words = tl.load(w_ptr + rows[:, None, None] * words_per_row + (w0 + word_in_tile)[None, :, :],
                        mask=mask_n[:, None, None], other=0)  # fmt: skip
        blk = rows[:, None] * blocks_per_row + (w0 // 8 + tl.arange(0, NB))[None, :]
        raw = tl.load(absmax_ptr + blk, mask=mask_n[:, None], other=0)
        if MODE == 0:
            acc += tl.sum(tl.sum((words & 1).to(tl.float32), axis=2) + raw.to(tl.float32), axis=1)
        else:
            scale = decode_absmax(raw, blk, mask_n[:, None], nested_code_ptr, nested_absmax_ptr, offset_ptr, True,
                                  NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
            q = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xF  # (BLOCK_N, NB, 8, 8)
            if MODE == 1:
                v = q.to(tl.float32) * 0.125 - 0.9375
            elif MODE == 4:
                v = (words[:, :, :, None] >> shifts[None, None, None, :]).to(tl.float32, bitcast=True)
            elif MODE == 2:
                v = tl.load(code_ptr + q)
            else:  # 3, 8, 9
                nib = words[:, :, :, None] >> shifts[None, None, None, :]
                v = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x101f, -1;", "=r,r,r", [entry, nib],
                                              dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
            if MODE >= 8:
                x4 = tl.load(x_ptr + w0 * 8 + x_in_tile[None, :, :, :]).to(tl.float32)
                if MODE == 8:
                    acc2 += tl.sum(tl.sum(v * x4, axis=3), axis=2) * scale
                else:
                    acc3 += tl.sum(v * x4, axis=3) * scale[:, :, None]
            elif MODE == 3 or MODE == 4:  # x loaded 4-D: its load fixes a layout with a word's 8 nibbles in-thread
                x4 = tl.load(x_ptr + w0 * 8 + x_in_tile[None, :, :, :]).to(tl.float32)
                per_block = tl.sum(tl.sum(v * x4, axis=3), axis=2)  # (BLOCK_N, NB)
            else:
                x = tl.load(x_ptr + w0 * 8 + x_in_tile).to(tl.float32)
                per_block = tl.sum(tl.sum(v * x[None, :, :, :], axis=3), axis=2)  # (BLOCK_N, NB)
            if MODE < 8:
                acc += tl.sum(per_block * scale, axis=1)
    if MODE == 8:
        acc = tl.sum(acc2, axis=1)
    elif MODE == 9:
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, acc, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc, mask=mask_n)


@triton.jit
def _probe_4bit_tc(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64
    j = tl.arange(0, 8)
    shifts = (j // 2) * 8 + (1 - j % 2) * 4
    word_in_tile = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8)
    cols = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((1,), tl.int32)], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip
    code = tl.load(code_ptr + (lane & 15))
    if MODE == 7:  # bf16 bits of the code in the low half
        entry = tl.reshape(code.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, (1, 1, 1, 1))
    else:
        entry = tl.reshape(code.to(tl.int32, bitcast=True), (1, 1, 1, 1))
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        words = tl.load(w_ptr + rows[:, None, None] * words_per_row + (w0 + word_in_tile)[None, :, :],
                        mask=mask_n[:, None, None], other=0)  # fmt: skip
        nib = words[:, :, :, None] >> shifts[None, None, None, :]  # (BLOCK_N, NB, 8, 8)
        if MODE == 7:
            blk = rows[:, None] * blocks_per_row + (w0 // 8 + cols)[None, :]  # (BLOCK_N, 16), NB used
            raw = tl.load(absmax_ptr + blk, mask=mask_n[:, None] & (cols < NB)[None, :], other=0)
        else:
            blk = rows[:, None] * blocks_per_row + (w0 // 8 + tl.arange(0, NB))[None, :]
            raw = tl.load(absmax_ptr + blk, mask=mask_n[:, None], other=0)
        if MODE == 6:
            w = nib.to(tl.int16).to(tl.bfloat16, bitcast=True)
            acc += raw.to(tl.float32).sum(axis=1)[:, None] * 1e-30
        else:
            bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x101f, -1;", "=r,r,r", [entry, nib],
                                             dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
            if MODE == 5:
                scale = decode_absmax(raw, blk, mask_n[:, None], nested_code_ptr, nested_absmax_ptr, offset_ptr, True,
                                      NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
                w = (bits.to(tl.float32, bitcast=True) * scale[:, :, None, None]).to(tl.bfloat16)
            else:
                w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        if MODE == 7:  # block-diagonal x: column b = x over absmax block b of the tile
            xt = tl.load(x_ptr + w0 * 8 + offs_k[:, None] + 0 * cols[None, :],
                         mask=(offs_k // 64)[:, None] == cols[None, :], other=0.0)  # fmt: skip
            per_block = tl.dot(w, xt)  # (BLOCK_N, 16)
            scale = decode_absmax(raw, blk, mask_n[:, None] & (cols < NB)[None, :], nested_code_ptr, nested_absmax_ptr,
                                  offset_ptr, True, NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
            acc += per_block * scale
        else:
            xt = tl.load(x_ptr + w0 * 8 + offs_k[:, None] + 0 * cols[None, :], mask=(cols == 0)[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
    result = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, result, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, result, mask=mask_n)


_DECODE_ASM: dict = {}


def prmt_table_words(code: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """The code table as 8 32-bit words for byte permutes: the low bytes of entries 0-3, 4-7, 8-11, 12-15 of the
    16-bit codes (``dtype``: bf16 or fp16), then their high bytes."""
    bits = code.to(dtype).view(torch.int16).to(torch.int32).cpu().tolist()
    lo = [b & 0xFF for b in bits]
    hi = [(b >> 8) & 0xFF for b in bits]
    return [sum(values[4 * i + j] << (8 * j) for j in range(4)) for values in (lo, hi) for i in range(4)]


def prmt_decode_asm(code: torch.Tensor, dtype: torch.dtype = torch.bfloat16, table_operands: bool = False) -> str:
    """PTX that decodes one 32-bit word of 8 nibbles ($4) into 8 16-bit codes ($0..$3, element pairs; ``dtype``:
    bf16 or fp16), by byte permutes from the code table's bytes in registers (no memory, no shuffles).

    With ``table_operands`` the table's 8 words (``prmt_table_words``) are operands $5..$12 and the constant 0x4444
    is $13, values the kernel loaded once: written as immediates, ptxas keeps them in uniform registers and copies
    one into a vector register before each permute that reads it (``IMAD.U32``), ~13 instructions a word."""
    if table_operands:
        names = [f"${5 + i}" for i in range(8)]
        movs, mask = "", "$13"
    else:
        names = ["t0", "t1", "t2", "t3", "h0", "h1", "h2", "h3"]
        movs = " ".join(f"mov.b32 {n}, {v};" for n, v in zip(names, prmt_table_words(code, dtype))) + " "
        mask = "0x4444"
    t0, t1, t2, t3, h0, h1, h2, h3 = names

    def half(src, out0, out1):
        return (f"and.b32 s, {src}, 0x7777; shr.b32 m, {src}, 1; and.b32 m, m, {mask}; or.b32 m, m, 0x3210; "
                f"prmt.b32 a, {t0}, {t1}, s; prmt.b32 b, {t2}, {t3}, s; prmt.b32 cl, a, b, m; "
                f"prmt.b32 a, {h0}, {h1}, s; prmt.b32 b, {h2}, {h3}, s; prmt.b32 ch, a, b, m; "
                f"prmt.b32 {out0}, cl, ch, 0x4051; prmt.b32 {out1}, cl, ch, 0x6273; ")  # fmt: skip

    return ("{ .reg .b32 t0, t1, t2, t3, h0, h1, h2, h3, s, m, a, b, cl, ch, w2; " + movs
            + half("$4", "$0", "$1") + "shr.b32 w2, $4, 16; " + half("w2", "$2", "$3") + "}")  # fmt: skip


def prmt_select_decode_asm() -> str:
    """``prmt_decode_asm`` with the table as operands ($5..$12), choosing each nibble's table half by a bit select
    under a byte mask made by a sign-replicating permute: the production kernel's ``PERMUTE_DECODE_PTX`` (its
    docstring says how)."""
    return PERMUTE_DECODE_PTX.value


@triton.jit
def _block_words_and_scale(
    w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, mask_n, words_per_row, blocks_per_row,
    word0, NESTED_BLOCKSIZE: tl.constexpr, MUL_RN: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_N, 8) words of the absmax block starting at word ``word0`` of each row, and its (BLOCK_N,) scales."""
    words = tl.load(w_ptr + rows[:, None] * words_per_row + (word0 + tl.arange(0, 8))[None, :], mask=mask_n[:, None],
                    other=0)  # fmt: skip
    blk = rows * blocks_per_row + word0 // 8
    raw = tl.load(absmax_ptr + blk, mask=mask_n, other=0)
    scale = decode_absmax(raw, blk, mask_n, nested_code_ptr, nested_absmax_ptr, offset_ptr, True, NESTED_BLOCKSIZE,
                          MUL_RN)  # fmt: skip
    return words, scale


@triton.jit
def _probe_4bit_tcprmt(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE_ASM: tl.constexpr,
):  # fmt: skip
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64
    cols = tl.arange(0, 16)
    wi = tl.arange(0, 8)
    kk = tl.arange(0, 64)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        for b in tl.static_range(NB):
            words, scale = _block_words_and_scale(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                                                  rows, mask_n, words_per_row, blocks_per_row, w0 + b * 8,
                                                  NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
            wide = words[:, :, None] ^ wi[None, None, :]  # distinct per element (see tcprmtb); j = 0 is the word
            w = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [wide], dtype=tl.bfloat16,
                                          is_pure=True, pack=8)  # fmt: skip
            w = tl.reshape(w, (BLOCK_N, 64))
            xt = tl.load(x_ptr + (w0 + b * 8) * 8 + kk[:, None] + 0 * cols[None, :], mask=(cols == 0)[None, :],
                         other=0.0)  # fmt: skip
            acc += tl.dot(w, xt) * scale[:, None]
    result = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, result, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, result, mask=mask_n)


@triton.jit
def _probe_4bit_tcprmtb(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE_ASM: tl.constexpr,
):  # fmt: skip
    """tcprmt with W as the MMA's second operand, x (16 rows, row 0 real) as the first, and K permuted within each
    64-wide block so that a thread's operand registers hold whole words: the MMA's operand layout gives a thread
    k = 2t, 2t+1, 2t+8, 2t+9 of each 16-wide step for one column; logical k = 32 s1 + 16 s0 + 8 h + 2 t + e is read
    from physical k = 8 (2 t + s1) + 4 s0 + 2 h + e, the same permutation for x and W (a sum over k does not care)."""
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64
    wi = tl.arange(0, 8)
    kl = tl.arange(0, 64)
    k_phys = 16 * ((kl >> 1) & 3) + 8 * (kl >> 5) + 4 * ((kl >> 4) & 1) + 2 * ((kl >> 3) & 1) + (kl & 1)
    xrows = tl.arange(0, 16)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        for b in tl.static_range(NB):
            words, scale = _block_words_and_scale(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                                                  rows, mask_n, words_per_row, blocks_per_row, w0 + b * 8,
                                                  NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
            if MODE == 12:  # one word in, its four bf16 pairs out; pairs split in-thread by truncation and join
                p0, p1, p2, p3 = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r", [words],
                                                           dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                           is_pure=True, pack=1)  # fmt: skip
                pairs = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # (BLOCK_N, 8, 2, 2): pair 2 i + j
                w = tl.join((pairs & 0xFFFF).to(tl.int16), (pairs >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)
            else:
                # Element j of a word's 8 carries word ^ j: distinct values (Triton folds a plain broadcast to one
                # register per word, and the 8-element pack then loses its layout); the decode reads only j = 0's.
                wide = words[:, :, None] ^ wi[None, None, :]
                w = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [wide], dtype=tl.bfloat16,
                                              is_pure=True, pack=8)  # fmt: skip  (BLOCK_N, word, j)
            w = tl.reshape(w, (BLOCK_N, 4, 2, 2, 2, 2))  # (n, t, s1, s0, h, e)
            w = tl.permute(w, (2, 3, 4, 1, 5, 0))  # (s1, s0, h, t, e, n)
            w = tl.reshape(w, (64, BLOCK_N))
            x_row = tl.load(x_ptr + (w0 + b * 8) * 8 + k_phys)  # (64,) in logical order
            xt = tl.where((xrows == 0)[:, None], x_row[None, :], 0.0).to(x_row.dtype)  # (16, 64): row 0 is x
            acc += tl.dot(xt, w) * scale[None, :]
    result = tl.sum(acc, axis=0)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, result, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, result, mask=mask_n)


@triton.jit
def _word_tile(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, mask_n, words_per_row,
               blocks_per_row, w0, word_in_tile, NB: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
               MUL_RN: tl.constexpr):  # fmt: skip
    """The (BLOCK_N, NB, 8) words of the tile starting at word ``w0`` and the (BLOCK_N, NB) scales of its blocks."""
    words = tl.load(w_ptr + rows[:, None, None] * words_per_row + (w0 + word_in_tile)[None, :, :],
                    mask=mask_n[:, None, None], other=0)  # fmt: skip
    blk = rows[:, None] * blocks_per_row + (w0 // 8 + tl.arange(0, NB))[None, :]
    raw = tl.load(absmax_ptr + blk, mask=mask_n[:, None], other=0)
    scale = decode_absmax(raw, blk, mask_n[:, None], nested_code_ptr, nested_absmax_ptr, offset_ptr, True,
                          NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip
    return words, scale


@triton.jit
def _pair_fma(acc, p, x_even_ptr, MASK_ODD: tl.constexpr):
    """``acc`` plus elements 2 i and 2 i + 1 of each word times their x: the elements from the word's bf16 pair ``p``
    (uint32: 2 i in the low half, 2 i + 1 in the high half) widened to fp32 by a shift and a mask; ``x_even_ptr``:
    (NB, 8) pointers to element 2 i's x. Two FMAs."""
    even = (p << 16).to(tl.float32, bitcast=True)
    odd = (p & 0xFFFF0000 if MASK_ODD else p).to(tl.float32, bitcast=True)
    acc = acc + even * tl.load(x_even_ptr).to(tl.float32)[None, :, :]
    return acc + odd * tl.load(x_even_ptr + 1).to(tl.float32)[None, :, :]


@triton.jit
def _probe_4bit_cuprmt(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE_ASM: tl.constexpr,
):  # fmt: skip
    """shfl (MODE 3 of ``_probe_4bit``) with the lookup by byte permutes: each (BLOCK_N, NB, 8) word decoded in its
    thread into four bf16 pairs (``prmt_decode_asm``, one word in, four registers out), each pair's elements times
    their x, summed per word, per absmax block, scaled. MODE 14 (cuprmt2) leaves out the odd element's mask."""
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64
    MASK_ODD: tl.constexpr = MODE == 13
    word_in_tile = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        words, scale = _word_tile(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, mask_n,
                                  words_per_row, blocks_per_row, w0, word_in_tile, NB, NESTED_BLOCKSIZE, MUL_RN)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.uint32,) * 4,
                                                   is_pure=True, pack=1)  # fmt: skip
        x_word = x_ptr + (w0 + word_in_tile) * 8  # (NB, 8): x of each word's element 0
        per_word = _pair_fma(tl.zeros((BLOCK_N, NB, 8), dtype=tl.float32), p0, x_word, MASK_ODD)  # one FMA chain
        per_word = _pair_fma(per_word, p1, x_word + 2, MASK_ODD)
        per_word = _pair_fma(per_word, p2, x_word + 4, MASK_ODD)
        per_word = _pair_fma(per_word, p3, x_word + 6, MASK_ODD)
        acc += tl.sum(tl.sum(per_word, axis=2) * scale, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, acc, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc, mask=mask_n)


@triton.jit
def _probe_int8(
    x_ptr, w_ptr, scb_ptr, out_ptr, N, words_per_row, words_per_split, n_words,
    ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    j = tl.arange(0, 4)
    word_in_tile = tl.arange(0, BLOCK_K // 4)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_K // 4):
        words = tl.load(w_ptr + rows[:, None] * words_per_row + (w0 + word_in_tile)[None, :], mask=mask_n[:, None],
                        other=0)  # fmt: skip
        q = (words[:, :, None] << (24 - 8 * j)[None, None, :]) >> 24  # sign-extended bytes, (BLOCK_N, BK/4, 4)
        x = tl.load(x_ptr + (w0 + word_in_tile)[:, None] * 4 + j[None, :]).to(tl.float32)
        acc += tl.sum(tl.sum(q.to(tl.float32) * x[None, :, :], axis=2), axis=1)
    acc = acc * tl.load(scb_ptr + offs_n, mask=mask_n, other=0.0) * INV_127
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, acc, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc, mask=mask_n)


# One word's dot product with its x in packed 16-bit FMAs: $1..$4 the word's code pairs (element 2 i in the low half),
# $5..$8 its x pairs, $0 the fp32 sum. The first FMA adds into a zero register (ptxas hoists the mov).
PACKED_DOT_ASM = {
    "bf16": PACKED_DOT_PTX.value,  # the production kernel's
    "fp16": ("{ .reg .b32 z, a; .reg .b16 l, h, s; mov.b32 z, 0; fma.rn.f16x2 a, $1, $5, z; "
             "fma.rn.f16x2 a, $2, $6, a; fma.rn.f16x2 a, $3, $7, a; fma.rn.f16x2 a, $4, $8, a; mov.b32 {l, h}, a; "
             "add.rn.f16 s, l, h; cvt.f32.f16 $0, s; }"),
}
# a bf16 x pair (one 32-bit word) to an fp16 pair
BF16X2_TO_F16X2_ASM = tl.constexpr(
    "{ .reg .b32 e, o; shl.b32 e, $1, 16; and.b32 o, $1, 0xFFFF0000; cvt.rn.f16x2.f32 $0, o, e; }")


@triton.jit
def _bcast(table_ptr, i: tl.constexpr, like):
    """Word ``i`` of the table, broadcast to ``like``'s shape (the load is hoisted out of the K loop)."""
    return tl.broadcast_to(tl.load(table_ptr + i), like.shape)


@triton.jit
def _x_pair(ptr, MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (NB, 8) x pairs at ``ptr`` as 32-bit words, in fp16 for MODE 16, broadcast over the tile's rows."""
    xi = tl.load(ptr)
    if MODE == 16 or MODE == 18:
        xi = tl.inline_asm_elementwise(BF16X2_TO_F16X2_ASM, "=r,r", [xi], dtype=tl.int32, is_pure=True, pack=1)
    return tl.broadcast_to(xi[None, :, :], (BLOCK_N, xi.shape[0], xi.shape[1]))


@triton.jit
def _probe_4bit_packed(
    x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, out_ptr,
    N, words_per_row, blocks_per_row, words_per_split, n_words,
    MODE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, ATOMIC: tl.constexpr, MUL_RN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE_ASM: tl.constexpr, DOT_ASM: tl.constexpr,
    table_ptr=None, TABLE_OPERANDS: tl.constexpr = False,
):  # fmt: skip
    """cuprmt (``_probe_4bit_cuprmt``) with each word's 8 products summed by packed 16-bit FMAs (``PACKED_DOT_ASM``);
    ``x_ptr`` is x as 32-bit words (bf16 pairs). MODES 16 and 18 (fp16) convert the x pairs to fp16 first; with
    ``TABLE_OPERANDS`` (MODES 17, 18) the decode reads the table's 8 words and its mask constant from ``table_ptr``
    (int32, loaded once) as operands."""
    offs_n, mask_n, rows, w_start, w_end = _program_rows(N, words_per_split, n_words, BLOCK_N)
    NB: tl.constexpr = BLOCK_K // 64
    word_in_tile = tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_K // 8):
        words, scale = _word_tile(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, mask_n,
                                  words_per_row, blocks_per_row, w0, word_in_tile, NB, NESTED_BLOCKSIZE, MUL_RN)
        if TABLE_OPERANDS:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                DECODE_ASM, "=r,=r,=r,=r" + ",r" * 10,
                [words, _bcast(table_ptr, 0, words), _bcast(table_ptr, 1, words), _bcast(table_ptr, 2, words),
                 _bcast(table_ptr, 3, words), _bcast(table_ptr, 4, words), _bcast(table_ptr, 5, words),
                 _bcast(table_ptr, 6, words), _bcast(table_ptr, 7, words), _bcast(table_ptr, 8, words)],
                dtype=(tl.uint32,) * 4, is_pure=True, pack=1)  # fmt: skip
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.uint32,) * 4,
                                                       is_pure=True, pack=1)  # fmt: skip
        x_pairs = x_ptr + (w0 + word_in_tile) * 4  # (NB, 8): each word's first x pair
        x0 = _x_pair(x_pairs, MODE, BLOCK_N)
        x1 = _x_pair(x_pairs + 1, MODE, BLOCK_N)
        x2 = _x_pair(x_pairs + 2, MODE, BLOCK_N)
        x3 = _x_pair(x_pairs + 3, MODE, BLOCK_N)
        per_word = tl.inline_asm_elementwise(DOT_ASM, "=f,r,r,r,r,r,r,r,r", [p0, p1, p2, p3, x0, x1, x2, x3],
                                             dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
        acc += tl.sum(tl.sum(per_word, axis=2) * scale, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, acc, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc, mask=mask_n)


# the variants that decode by byte permutes, and their kernels (each takes the decode's PTX as DECODE_ASM)
PRMT_KERNELS = {MODES["tcprmt"]: _probe_4bit_tcprmt, MODES["tcprmtb"]: _probe_4bit_tcprmtb,
                MODES["tcprmtc"]: _probe_4bit_tcprmtb, MODES["cuprmt"]: _probe_4bit_cuprmt,
                MODES["cuprmt2"]: _probe_4bit_cuprmt, MODES["cuh2"]: _probe_4bit_packed,
                MODES["cuh2h"]: _probe_4bit_packed, MODES["cuh2r"]: _probe_4bit_packed,
                MODES["cuh2hr"]: _probe_4bit_packed, MODES["cuh2s"]: _probe_4bit_packed}  # fmt: skip


def launch_4bit(x, weight, out, mode, split, tile):
    block_n, block_k, warps = tile
    n, k = weight.shape
    n_words = k // 8
    words_per_split = C.cdiv(C.cdiv(n_words, block_k // 8), split) * (block_k // 8)
    grid = (C.cdiv(n, block_n), C.cdiv(n_words, words_per_split))
    words = weight.data.reshape(-1).view(torch.uint8).view(torch.int32)
    extra = {}
    if mode in PRMT_KERNELS:
        kernel = PRMT_KERNELS[mode]
        half = torch.float16 if mode in (MODES[m] for m in FP16_MODES) else torch.bfloat16
        operands = mode in (MODES[m] for m in TABLE_OPERAND_MODES)
        key = (weight.code.data_ptr(), mode)  # made outside CUDA-graph capture: the warm-up call comes first
        if key not in _DECODE_ASM:
            table_words = prmt_table_words(weight.code, half) + [0x4444]
            table = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in table_words], dtype=torch.int32,
                                 device=weight.code.device)  # fmt: skip
            select = mode == MODES["cuh2s"]
            _DECODE_ASM[key] = (prmt_select_decode_asm() if select else prmt_decode_asm(weight.code, half, operands),
                                table)  # fmt: skip
        extra["DECODE_ASM"], table = _DECODE_ASM[key]
        if kernel is _probe_4bit_packed:
            extra["DOT_ASM"] = PACKED_DOT_ASM["fp16" if half == torch.float16 else "bf16"]
            x = x.view(torch.int32)
            if operands:
                extra.update(table_ptr=table, TABLE_OPERANDS=True)
    else:
        kernel = _probe_4bit_tc if mode in (MODES[m] for m in TC_MODES) else _probe_4bit
    kernel[grid](x, words, weight.absmax, weight.nested_code, weight.nested_absmax, weight.offset, weight.code,
                      out, n, n_words, k // 64, words_per_split, n_words, MODE=mode,
                      NESTED_BLOCKSIZE=weight.nested_blocksize, ATOMIC=grid[1] > 1, MUL_RN=x.is_cuda,
                      BLOCK_N=block_n, BLOCK_K=block_k, **extra,
                      num_warps=warps, num_stages=1)  # fmt: skip


def launch_int8(x, weight, out, split, tile):
    block_n, block_k, warps = tile
    n, k = weight.shape
    n_words = k // 4
    words_per_split = C.cdiv(C.cdiv(n_words, block_k // 4), split) * (block_k // 4)
    grid = (C.cdiv(n, block_n), C.cdiv(n_words, words_per_split))
    _probe_int8[grid](x, weight.cb.view(torch.int32), weight.scb, out, n, n_words, words_per_split, n_words,
                      ATOMIC=grid[1] > 1, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=1)  # fmt: skip


def timed(fn_for_copy, copies: int, zero: list) -> float:
    def make(i):
        def call():
            if zero[i] is not None:
                zero[i].zero_()
            fn_for_copy(i)

        return call

    return C.graph_time_us([make(i) for i in range(copies)])


def measure_kind(kind: str, wq, w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, copy_gbs: float, l2_mb: float,
                 rows: list[dict], start: float, variants: list[str], tiles_4bit: list,
                 splits=SPLITS) -> None:  # fmt: skip
    """Times the production kernel and every probe variant of one weight kind and shape; appends rows."""
    from peft_fastlora.ops.kernels.small_m import pick_config, small_m_linear_tiled, weight_kind

    device = x.device
    n, k = wq.shape
    nbytes = C.weight_bytes(wq)
    copies = C.copies_for(nbytes, l2_mb)
    requantize = (lambda: C.quantize_nf4(w)[0]) if kind == "nf4" else (lambda: C.quantize_int8(w)[0])
    clones = [wq] + [requantize() for _ in range(copies - 1)]
    outs = [torch.zeros(n, device=device, dtype=torch.float32) for _ in range(copies)]

    def record(variant, tile, split, us, err=None):
        gbs = nbytes / (us * 1e-6) / 1e9 if math.isfinite(us) else None  # NaN: a wrong result, not timed
        rows.append(dict(kind=kind, shape=f"{n}x{k}", variant=variant, tile=str(tile), split=split,
                         us=round(us, 2) if gbs else us, GBps=round(gbs) if gbs else None,
                         pct_copy=round(100 * gbs / copy_gbs, 1) if gbs else None, rel_err=err))  # fmt: skip

    # the production kernel with its tuned tiling, without and with an r=16 LoRA term
    config = pick_config(1, n, k, device, weight_kind(wq))
    a = torch.randn(16, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, 16, device=device, dtype=torch.bfloat16)
    for lora in ((None, None, None), (x, a, b)):
        calls = [lambda c=c, lora=lora: small_m_linear_tiled(x, c, None, *lora, 2.0, config) for c in clones]
        us = C.graph_time_us(calls)
        record("production+lora" if lora[0] is not None else "production", config.to_json(), config.split_k, us)

    def launch(weight, out, variant, split, tile):
        if kind == "nf4":
            launch_4bit(x, weight, out, MODES[variant], split, tile)
        else:
            launch_int8(x, weight, out, split, tile)

    variants = variants if kind == "nf4" else ["int8"] if variants else []  # none: production only
    pairs = [(v, t) for v in variants for t in (TILES_INT8 if kind == "int8" else TILES_TC if v in TC_MODES
                                                else tiles_4bit)]  # fmt: skip
    for variant, tile in pairs:
        best = None
        for split in splits:
            try:
                err = None
                if variant in CHECKED:  # correctness first
                    out = torch.zeros(n, device=device)
                    launch(wq, out, variant, split, tile)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    if not err <= (1e-2 if variant in BF16_CHECKED else 1e-3):  # bf16-rounded W or codes
                        record(variant, tile, split, float("nan"), err)
                        continue
                zero = outs if split > 1 else [None] * copies
                us = timed(lambda i, s=split, v=variant, t=tile: launch(clones[i], outs[i], v, s, t), copies, zero)
            except Exception as e:  # a tile that does not compile or fit
                print(f"  {kind} {variant} {tile} split {split}: {C.short_error(e)}", flush=True)
                break
            record(variant, tile, split, us, err)
            best = us if best is None else min(best, us)
        print(f"  {kind} {n}x{k} {variant:7s} {tile}: best {best} us [t={time.monotonic() - start:.0f}s]", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--l2-mb", type=float, default=50.0)
    p.add_argument("--shapes", default=None, help="NxK list")
    p.add_argument("--kinds", default="nf4,int8", help="nf4,int8")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"nf4 variants, of {list(MODES)}")
    p.add_argument("--splits", default=None, help="split-K values to try (default: 1,2,4,8,16)")
    p.add_argument("--tiles", default=None, help="CUDA-core nf4 tiles BLOCK_N:BLOCK_K:warps,... (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_small_m.py times CUDA kernels and needs a GPU; nothing to do here.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    env = C.env_info(device)
    C.print_header("small-M probe (M = 1)", env)
    copy_gbs = C.copy_bandwidth_gbps(device)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    variants = [v for v in args.variants.split(",") if v]  # none: the production kernel only
    splits = tuple(int(v) for v in args.splits.split(",")) if args.splits else SPLITS
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")] if args.tiles else TILES_4BIT
    from peft_fastlora.ops import dequantize

    rows: list[dict] = []
    start = time.monotonic()
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        for kind, quantize in (("nf4", C.quantize_nf4), ("int8", C.quantize_int8)):
            if kind not in args.kinds.split(","):
                continue
            wq = quantize(w)[0]
            ref = (x.float() @ dequantize(wq, torch.float32).T).reshape(-1)
            measure_kind(kind, wq, w, x, ref, copy_gbs, args.l2_mb, rows, start, variants, tiles, splits)
            torch.cuda.empty_cache()
    cols = ["kind", "shape", "variant", "tile", "split", "us", "GBps", "pct_copy", "rel_err"]
    C.CsvLog(args.out / "probe_small_m.csv", cols, env).rewrite(rows)
    for kind, shape, variant in sorted({(r["kind"], r["shape"], r["variant"]) for r in rows}):
        ok = [r for r in rows if (r["kind"], r["shape"], r["variant"]) == (kind, shape, variant) and r["us"] == r["us"]]
        if ok:
            r = min(ok, key=lambda r: r["us"])
            print(f"BEST {kind} {shape} {variant:16s} {r['us']:7.2f} us {r['GBps']:5d} GB/s {r['pct_copy']:5.1f} % "
                  f"tile {r['tile']} split {r['split']}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
