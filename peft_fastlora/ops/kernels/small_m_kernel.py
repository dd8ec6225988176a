"""The fused small-M kernel: quantized linear + LoRA for a handful of rows (decoding), in one launch.

``y = x @ W.T + b + s * (x_lora @ A.T) @ B.T``. For M <= ~16 rows the cost is reading W, so the kernel streams the
packed 4-bit (or int8) weight once, dequantizes it in registers and never writes it back. Each program owns
``BLOCK_N`` output features of ``BLOCK_M`` rows and a ``K / SPLIT_K`` slice of the reduction:

    M == 1  CUDA cores: acc[n] += sum_k W_tile[n, k] * x[k] in fp32 (tensor cores would idle 15/16 of the MMA).
    M > 1   tensor cores on the swapped product: acc (BLOCK_N, BLOCK_M) += W_tile (BLOCK_N, BLOCK_K) @ x_tile.T,
            so the tiny M only has to fill the 16-wide side of the MMA.

The reads of the next tile (codes, scales, x) are issued before the current one is decoded (software prefetch), so
each program keeps two tiles of DRAM reads in flight without spending registers on decoded values.

With ``SPLIT_K > 1`` every program stores its fp32 partial sums in a workspace and bumps a per-tile counter; the
program that arrives last adds the partials in split order (deterministic) and runs the epilogue: bias, the LoRA
term ``(x_lora @ A.T) @ B.T`` and the cast to ``x.dtype``. No host syncs and data-independent allocations, so it can
be captured in a CUDA graph.

The LoRA down-projection ``xa = x_lora @ A.T`` is made inside the same launch, in K chunks by the first programs of
the grid; ``small_m_lora.py`` holds that part and the epilogue.

Numerics follow ``reference.lora_linear_ref``: W is dequantized exactly as the dequant kernel does and rounded to
``x.dtype`` before the multiply; sums are fp32 (in a different order than torch, hence the test tolerances). One
exception, ``FACTOR_SCALES`` (M = 1, 4-bit rows of whole absmax blocks, the default there): each block's
``code * x`` products are summed first and scaled once, so W is never rounded to ``x.dtype`` (more accurate than the
reference; the tests bound it against the fp32 W). That path reads W as 32-bit words (8 weights). Compiled kernels
look 4-bit codes up (on both paths) with warp shuffles from a table held one entry per lane (``SHUFFLE_LUT``): one
instruction per weight instead of the five of a gather from memory (docs/kernels.md has the measurements).
``PACKED_DOT`` (M = 1, ``FACTOR_SCALES``, bf16 rows, compiled kernels) decodes each word in its thread by byte
permutes from the code table's bf16 bytes held in registers and sums its 8 products in four ``bf16x2`` FMAs: 5.3-6.1
instructions per weight in the loop instead of 14-16.4 (sm_90 SASS), at the price of codes rounded to bf16 and each
word's partial sums rounded to bf16 (``_packed_word_sums``; the tests bound that rounding).

The launcher, ``small_m.py``, chooses the tiling and builds the argument list.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import INV_127, decode_absmax, decode_nibbles, round_to
from .small_m_lora import epilogue, store_lora_down_chunk

# How the kernel reads W (``WEIGHT_KIND``). ALIGNED: 4-bit with rows made of whole absmax blocks (K % blocksize == 0,
# every real model), loaded as (BLOCK_N, sub-blocks, bytes) so one scale serves a run of bytes. ANY: 4-bit of any
# shape, one gather per element. INT8: row-scaled int8.
WEIGHT_4BIT_ALIGNED: tl.constexpr = tl.constexpr(0)
WEIGHT_4BIT_ANY: tl.constexpr = tl.constexpr(1)
WEIGHT_INT8: tl.constexpr = tl.constexpr(2)


def _permute_decode_ptx() -> str:
    """PTX decoding one word of 8 nibbles ($4) into its 8 bf16 codes as four pairs ($0..$3: elements 2 i and 2 i + 1
    in the low and high half of $i), from the code table's bytes in $5..$12 (``_permute_table``).

    Per 4 nibbles: their low 3 bits select bytes from entries 0-7 and 8-15 of the low-byte and high-byte tables (4
    ``prmt``); a byte mask from the nibbles' top bits (a ``prmt`` in sign-replicate mode: ``v = word << 4`` puts the
    top bit of the even nibbles at the top of a byte, the odd nibbles have theirs there already) picks 8-15 where set
    (``lop3`` 0xD8, ``m ? b : a``), and two more ``prmt`` interleave low and high bytes into bf16 pairs, the even
    element (the byte's high nibble) low. 22 instructions a word, no memory, no shuffle; the table words are operands,
    not immediates, because ptxas would otherwise copy them from uniform registers before every permute."""

    def half(src, mask_selector, out0, out1):
        return (f"and.b32 s, {src}, 0x7777; prmt.b32 m, $4, v, {mask_selector}; "
                "prmt.b32 a, $5, $6, s; prmt.b32 b, $7, $8, s; lop3.b32 lo, a, b, m, 0xD8; "
                "prmt.b32 a, $9, $10, s; prmt.b32 b, $11, $12, s; lop3.b32 hi, a, b, m, 0xD8; "
                f"prmt.b32 {out0}, lo, hi, 0x4051; prmt.b32 {out1}, lo, hi, 0x6273; ")  # fmt: skip

    return ("{ .reg .b32 s, v, m, a, b, lo, hi, w2; shl.b32 v, $4, 4; " + half("$4", "0x9D8C", "$0", "$1")
            + "shr.b32 w2, $4, 16; " + half("w2", "0xBFAE", "$2", "$3") + "}")  # fmt: skip


PERMUTE_DECODE_PTX: tl.constexpr = tl.constexpr(_permute_decode_ptx())


def _permute_table_ptx() -> str:
    """PTX making the 8 table words of ``PERMUTE_DECODE_PTX`` ($0..$7) from the fp32 code table held one entry per
    lane ($8, lane L holding entry L % 16): entry e fetched by a shuffle, entries paired into bf16x2 (round to nearest
    even, as a cast), the pairs' low and high bytes gathered by permutes. Runs once per program.

    Each half-warp reads entry e from its own copy (lane e, or e + 16): with one source lane for the whole warp, ptxas
    knows the words are warp-uniform, keeps them in uniform registers and copies one into a vector register before
    every permute that reads it (about one instruction per weight)."""
    fetch = " ".join(f"or.b32 i, half, {e}; shfl.sync.idx.b32 c{e}, $8, i, 0x1f, -1;" for e in range(16))
    pairs = " ".join(f"cvt.rn.bf16x2.f32 p{i}, c{2 * i + 1}, c{2 * i};" for i in range(8))
    words = " ".join(f"prmt.b32 ${i}, p{2 * i}, p{2 * i + 1}, 0x6420; "
                     f"prmt.b32 ${4 + i}, p{2 * i}, p{2 * i + 1}, 0x7531;" for i in range(4))  # fmt: skip
    return ("{ .reg .b32 c<16>, p<8>, i, half; mov.u32 half, %laneid; and.b32 half, half, 16; " + fetch + " " + pairs
            + " " + words + " }")  # fmt: skip


PERMUTE_TABLE_PTX: tl.constexpr = tl.constexpr(_permute_table_ptx())
# One word's dot product with its x: code pairs $1..$4 times x pairs $5..$8 in packed bf16 FMAs (each half of the
# accumulator sums 4 products, rounding to bf16 at each step), then the two halves widened to fp32 and added ($0).
PACKED_DOT_PTX: tl.constexpr = tl.constexpr(
    "{ .reg .b32 z, a, e, o; mov.b32 z, 0; fma.rn.bf16x2 a, $1, $5, z; fma.rn.bf16x2 a, $2, $6, a; "
    "fma.rn.bf16x2 a, $3, $7, a; fma.rn.bf16x2 a, $4, $8, a; shl.b32 e, a, 16; and.b32 o, a, 0xFFFF0000; "
    "add.f32 $0, e, o; }"
)


@triton.jit
def _sub_block_index(offs_n, k0, k_end, N, K, BLOCKSIZE: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr):
    """(BLOCK_N, NB) absmax index of each SUB-element sub-block of the tile W[offs_n, k0 : k0 + NB * SUB] (rows of
    whole absmax blocks), and the mask of those inside the matrix and before ``k_end``."""
    sub_start = k0 + tl.arange(0, NB) * SUB
    block_idx = offs_n.to(tl.int64)[:, None] * (K // BLOCKSIZE) + (sub_start // BLOCKSIZE)[None, :]
    return block_idx, (offs_n < N)[:, None] & (sub_start < k_end)[None, :]


@triton.jit
def _sub_block_scales(
    raw_scale, nested_code_ptr, nested_absmax_ptr, offset_ptr, offs_n, k0, k_end, N, K,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, SUB: tl.constexpr,
    NB: tl.constexpr, MUL_RN: tl.constexpr,
):  # fmt: skip
    """The fp32 (BLOCK_N, NB) scales of the sub-blocks whose stored scales ``raw_scale`` were loaded at
    [`_sub_block_index`]."""
    block_idx, mask = _sub_block_index(offs_n, k0, k_end, N, K, BLOCKSIZE, SUB, NB)
    return decode_absmax(raw_scale, block_idx, mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED,
                         NESTED_BLOCKSIZE, MUL_RN)  # fmt: skip


@triton.jit
def _load_weight_raw(
    w_ptr,
    absmax_ptr,  # 4-bit: fp32 scales or uint8 codes (NESTED); int8: fp32 row scales (scb)
    offs_n,  # (BLOCK_N,) output features
    k0,  # first input feature of the tile
    k_end,  # end of this program's K range: reads stop there, so a prefetch past it costs nothing
    N,
    K,
    stride_wn,  # bytes (4-bit) or elements (int8) per weight row
    WEIGHT_KIND: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,  # ALIGNED: elements per sub-block = min(BLOCKSIZE, BLOCK_K), all under one scale
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The DRAM reads of the tile W[offs_n, k0 : k0 + BLOCK_K]: (stored codes, stored scales), not yet decoded."""
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    if WEIGHT_KIND == WEIGHT_4BIT_ALIGNED:
        sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB  # (NB,) first element of each sub-block
        byte_in_row = (sub_start // 2)[:, None] + tl.arange(0, SUB // 2)[None, :]  # (NB, SUB/2)
        mask = mask_n[:, None, None] & (byte_in_row < k_end // 2)[None, :, :]
        packed = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte_in_row[None, :, :], mask=mask, other=0)
        block_idx, scale_mask = _sub_block_index(offs_n, k0, k_end, N, K, BLOCKSIZE, SUB, BLOCK_K // SUB)
        raw_scale = tl.load(absmax_ptr + block_idx, mask=scale_mask, other=0)
    elif WEIGHT_KIND == WEIGHT_4BIT_ANY:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        idx = rows[:, None] * K + offs_k[None, :]  # element index in the flattened weight
        packed = tl.load(w_ptr + idx // 2, mask=mask, other=0)
        raw_scale = tl.load(absmax_ptr + idx // BLOCKSIZE, mask=mask, other=0)
    else:  # WEIGHT_INT8
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        raw_scale = tl.load(absmax_ptr + offs_n, mask=mask_n, other=0.0)
    return packed, raw_scale


@triton.jit
def _decode_weight_tile(
    packed,
    raw_scale,
    lane_entry,  # (1, 1, 1, 1) from _lane_code_entry (SHUFFLE_LUT)
    code_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    offs_n,
    k0,
    k_end,
    N,
    K,
    WEIGHT_KIND: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    MUL_RN: tl.constexpr,
    SHUFFLE_LUT: tl.constexpr,
):
    """The (BLOCK_N, BLOCK_K) tile from ``_load_weight_raw``, dequantized exactly and rounded to ``DTYPE``.

    4-bit codes are looked up as on the M = 1 path ([`_lookup_codes`]): by warp shuffle in compiled kernels, which
    gives the same fp32 table entries as a gather in fewer instructions per weight."""
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    if WEIGHT_KIND == WEIGHT_4BIT_ALIGNED:
        scale = _sub_block_scales(raw_scale, nested_code_ptr, nested_absmax_ptr, offset_ptr, offs_n, k0, k_end, N, K,
                                  BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K // SUB, MUL_RN)  # fmt: skip
        scale = scale[:, :, None]
        if SHUFFLE_LUT:
            codes = packed.to(tl.int32)
            lane_entry = tl.reshape(lane_entry, (1, 1, 1))
            high = _lookup_codes(codes >> 4, lane_entry, code_ptr, SHUFFLE_LUT)
            low = _lookup_codes(codes, lane_entry, code_ptr, SHUFFLE_LUT)
        else:
            high, low = decode_nibbles(packed, code_ptr)
        w = tl.interleave(round_to(high * scale, DTYPE, INTERPRET), round_to(low * scale, DTYPE, INTERPRET))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # (BLOCK_N, NB, SUB) -> (BLOCK_N, BLOCK_K)
    elif WEIGHT_KIND == WEIGHT_4BIT_ANY:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        idx = rows[:, None] * K + offs_k[None, :]
        shift = (4 - (idx % 2) * 4).to(tl.int32)  # even element: high nibble
        value = tl.load(code_ptr + ((packed.to(tl.int32) >> shift) & 0xF))
        scale = decode_absmax(
            raw_scale, idx // BLOCKSIZE, mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE,
            MUL_RN,
        )
        w = round_to(value * scale, DTYPE, INTERPRET)
    else:  # WEIGHT_INT8
        w = round_to(packed.to(tl.float32) * raw_scale[:, None] * INV_127, DTYPE, INTERPRET)
    return w


@triton.jit
def _lane_code_entry(code_ptr):
    """This lane's entry of the 16-value code table, ``code[lane % 16]``, as int32 bits in a (1, 1, 1, 1) tensor.

    Every lane of a half-warp then holds one table entry, and a warp shuffle inside the half-warp reads entry ``q``
    from lane ``q`` ([`_lookup_codes`]). (A one-element tensor is held, not shared, by every thread: each keeps
    its own lane's value.)
    """
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((1,), tl.int32)], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip
    return tl.reshape(tl.load(code_ptr + (lane & 15)).to(tl.int32, bitcast=True), (1, 1, 1, 1))


@triton.jit
def _lookup_codes(nibbles, lane_entry, code_ptr, SHUFFLE_LUT: tl.constexpr):
    """fp32 ``code[nibbles & 15]`` (only the low 4 bits of ``nibbles`` count).

    ``SHUFFLE_LUT`` (compiled kernels): a ``shfl.sync.idx`` per weight from the lanes' table entries; its 16-lane
    segments (``c = 0x101f``) take the source lane modulo 16, so the nibble needs no mask and the address no
    arithmetic: one instruction instead of the five of a gather (mask, 64-bit address, load). Otherwise (the
    interpreter) a gather from ``code_ptr``.
    """
    if SHUFFLE_LUT:
        bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x101f, -1;", "=r,r,r", [lane_entry, nibbles],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        value = bits.to(tl.float32, bitcast=True)
    else:
        value = tl.load(code_ptr + (nibbles & 15))
    return value


@triton.jit
def _load_words(
    w_ptr,  # the packed weight as int32 words (8 elements each)
    absmax_ptr,
    x_row_ptr,
    offs_n,
    k0,  # first input feature of the tile (a multiple of 8)
    k_end,
    N,
    K,
    stride_wn,  # words per weight row
    BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED_DOT: tl.constexpr,
):
    """The DRAM reads of one FACTOR_SCALES tile: W[offs_n, k0 : k0 + BLOCK_K] as (BLOCK_N, NB, SUB / 8) int32 words,
    the (BLOCK_N, NB) stored scales and x[k0 : k0 + BLOCK_K] as fp32 (1, NB, SUB / 8, 8), NB = BLOCK_K / SUB; with
    ``PACKED_DOT`` x as its bf16 pairs, (1, NB, SUB / 8, 4) int32 (the row 4-byte aligned: the launcher's check).

    x is loaded 4-D on purpose: its load fixes the layout of the decoded (BLOCK_N, NB, SUB / 8, 8) tile so that each
    thread holds whole words (8 weights of one row) and reduces them in registers.
    """
    NB: tl.constexpr = BLOCK_K // SUB
    WPB: tl.constexpr = SUB // 8
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    # k0 and k_end are multiples of SUB (k_per_split is one of BLOCK_K, K one of BLOCKSIZE). Said to the compiler
    # (``multiple_of``) and used for a mask per sub-block rather than per word, this lets a thread load 4 words as
    # one 16-byte vector; Triton only knew k0 as a multiple of 16 (2 words) and split the loads into 8-byte ones.
    word = tl.multiple_of(k0 // 8, WPB) + tl.arange(0, NB)[:, None] * WPB + tl.arange(0, WPB)[None, :]  # (NB, WPB)
    in_range = (k0 + tl.arange(0, NB) * SUB < k_end)[:, None]  # (NB, 1)
    mask = mask_n[:, None, None] & in_range[None, :, :]
    words = tl.load(w_ptr + rows[:, None, None] * stride_wn + word[None, :, :], mask=mask, other=0)
    block_idx, scale_mask = _sub_block_index(offs_n, k0, k_end, N, K, BLOCKSIZE, SUB, NB)
    raw_scale = tl.load(absmax_ptr + block_idx, mask=scale_mask, other=0)
    if PACKED_DOT:
        pair = word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # (NB, WPB, 4)
        x_pairs = x_row_ptr.to(tl.pointer_type(tl.int32))
        x = tl.load(x_pairs + pair[None, :, :, :], mask=in_range[None, :, :, None], other=0)
    else:
        k = word[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # (NB, WPB, 8)
        x = tl.load(x_row_ptr + k[None, :, :, :], mask=in_range[None, :, :, None], other=0.0)
        x = x.to(tl.float32)
    return words, raw_scale, x


@triton.jit
def _factored_row_dot(
    words,  # (BLOCK_N, NB, SUB / 8) int32, from _load_words
    raw_scale,  # (BLOCK_N, NB)
    x,  # (1, NB, SUB / 8, 8) fp32
    lane_entry,
    code_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    offs_n,
    k0,
    k_end,
    N,
    K,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_RN: tl.constexpr,
    SHUFFLE_LUT: tl.constexpr,
):
    """(BLOCK_N,) fp32: sum_k W[n, k] * x[k] over the tile as sum_blocks scale[n, b] * sum_{k in b} code[n, k] * x[k].

    Per weight: a shift, a table lookup ([`_lookup_codes`]) and an FMA; the scale multiply happens once per
    sub-block of SUB weights. Element ``8 w + j`` of word ``w`` sits in byte ``j // 2`` (little-endian), in the high
    nibble for even ``j``: shift ``8 (j // 2) + 4 (1 - j % 2)``.
    """
    scale = _sub_block_scales(raw_scale, nested_code_ptr, nested_absmax_ptr, offset_ptr, offs_n, k0, k_end, N, K,
                              BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K // SUB, MUL_RN)  # (BLOCK_N, NB)
    j = tl.arange(0, 8)
    shifts = (j // 2) * 8 + (1 - j % 2) * 4
    values = _lookup_codes(words[:, :, :, None] >> shifts[None, None, None, :], lane_entry, code_ptr, SHUFFLE_LUT)
    per_block = tl.sum(tl.sum(values * x, axis=3), axis=2)  # (BLOCK_N, NB)
    return tl.sum(per_block * scale, axis=1)


@triton.jit
def _permute_table(lane_entry):
    """The 16-entry code table as the 8 words ``PERMUTE_DECODE_PTX`` reads (low bytes of entries 0-3, 4-7, 8-11,
    12-15, then their high bytes), each (1, 1, 1) int32, from ``lane_entry`` ([`_lane_code_entry`]) by
    ``PERMUTE_TABLE_PTX``. Built from shuffles, the words are per-thread values to ptxas: made from the fp32 table by
    uniform loads, they went to uniform registers, and a copy into a vector register preceded every permute."""
    entry = tl.reshape(lane_entry, (1, 1, 1))
    return tl.inline_asm_elementwise(PERMUTE_TABLE_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [entry],
                                     dtype=(tl.int32,) * 8, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _packed_word_sums(words, scale, x_pairs, table):
    """[`_factored_row_dot`] in packed bf16 math, per word: (BLOCK_N, NB, SUB / 8) fp32 ``scale * sum(code * x)``
    over each word's 8 weights, from the words (``_load_words``), the (BLOCK_N, NB) decoded sub-block scales, x's bf16
    pairs as (1, NB, SUB / 8, 4) int32 and the 8 table words (``_permute_table``). Each word is decoded in its thread
    by byte permutes (``PERMUTE_DECODE_PTX``) and its products are summed by four ``bf16x2`` FMAs
    (``PACKED_DOT_PTX``). The caller keeps these sums across the K loop and reduces them once after it (an FMA per
    word a step instead of a cross-lane reduction per step)."""
    NB: tl.constexpr = words.shape[1]
    WPB: tl.constexpr = words.shape[2]
    t0, t1, t2, t3, h0, h1, h2, h3 = table  # each (1, 1, 1)
    shape: tl.constexpr = words.shape
    p0, p1, p2, p3 = tl.inline_asm_elementwise(
        PERMUTE_DECODE_PTX, "=r,=r,=r,=r" + ",r" * 9,
        [words, tl.broadcast_to(t0, shape), tl.broadcast_to(t1, shape), tl.broadcast_to(t2, shape),
         tl.broadcast_to(t3, shape), tl.broadcast_to(h0, shape), tl.broadcast_to(h1, shape),
         tl.broadcast_to(h2, shape), tl.broadcast_to(h3, shape)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    # pairs (0, 2) and (1, 3) by the first split, then each pair by the second
    even, odd = tl.split(tl.reshape(x_pairs, (1, NB, WPB, 2, 2)))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    per_word = tl.inline_asm_elementwise(
        PACKED_DOT_PTX, "=f,r,r,r,r,r,r,r,r",
        [p0, p1, p2, p3, tl.broadcast_to(x0, shape), tl.broadcast_to(x1, shape), tl.broadcast_to(x2, shape),
         tl.broadcast_to(x3, shape)],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip
    return per_word * scale[:, :, None]


@triton.jit
def _load_x_tile(x_ptr, offs_m, k0, k_end, M, stride_xm, USE_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[offs_m, k0 : k0 + BLOCK_K]: transposed (BLOCK_K, BLOCK_M) for the MMA, or the single row as (1, BLOCK_K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if USE_DOT:
        ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        tile = tl.load(ptrs, mask=(offs_k < k_end)[:, None] & (offs_m < M)[None, :], other=0.0)
    else:  # BLOCK_M == 1; 2-D so it lands in the layout of the weight tile without a shuffle
        tile = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=(offs_k < k_end)[None, :], other=0.0)
    return tile


@triton.jit
def _fused_small_m_kernel(
    x_ptr,  # (M, K), unit stride along K
    w_ptr,  # packed uint8 bytes (4-bit) or int8 (N, K)
    absmax_ptr,
    code_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    bias_ptr,  # (N,)
    lx_ptr,  # (M, K) LoRA input rows (x or x_lora), unit stride along K
    lora_a_ptr,  # (R, K)
    lora_b_ptr,  # (N, R)
    out_ptr,  # (M, N) in x.dtype
    partial_ptr,  # (SPLIT_K, M, N) fp32 workspace (SPLIT_K > 1)
    arrivals_ptr,  # (tiles,) int32 zeros (SPLIT_K > 1)
    xa_part_ptr,  # (m tiles, XA_MAX_CHUNKS, BLOCK_R * BLOCK_M) fp32 workspace (HAS_LORA)
    xa_count_ptr,  # (m tiles, XA_COPIES, XA_COPY_STRIDE) int32 zeros (HAS_LORA)
    M,
    N,
    K,
    R,
    scaling,
    stride_xm,
    stride_wn,
    stride_lxm,
    stride_an,
    stride_bn,
    stride_om,
    k_per_split,  # multiple of BLOCK_K
    n_chunks,  # K chunks of xa, each made by one program: n_chunks <= programs per M tile
    xa_chunk,  # multiple of XA_BLOCK_K
    WEIGHT_KIND: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 inputs: exact fp32 dot (also the interpreter, whose bf16 dot is broken)
    LORA_DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
    XA_MAX_CHUNKS: tl.constexpr,
    XA_COPIES: tl.constexpr,  # copies of each chunk counter, XA_COPY_STRIDE int32 apart (own 128-byte lines)
    XA_COPY_STRIDE: tl.constexpr,
    XA_POLLS: tl.constexpr,  # counter polls before an epilogue makes the xa chunks itself (0: interpreter)
    INTERPRET: tl.constexpr,
    FACTOR_SCALES: tl.constexpr,  # M = 1, ALIGNED 4-bit, W as int32 words: scale per sub-block (_factored_row_dot)
    MUL_RN: tl.constexpr,  # exact nested-absmax decode with fp fusion on (compiled kernels; see _decode_absmax)
    SHUFFLE_LUT: tl.constexpr,  # 4-bit code lookups by warp shuffle (compiled kernels; see _lookup_codes)
    PACKED_DOT: tl.constexpr,  # FACTOR_SCALES in packed bf16 math (compiled kernels, bf16 rows; _packed_word_sums)
    LOAD_STAGES: tl.constexpr,  # FACTOR_SCALES: > 1, tiles staged by Triton's pipeliner (cp.async), not prefetched
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x_ty = x_ptr.dtype.element_ty
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    if HAS_LORA:
        # Programs are dispatched in order of their linear id (pid_n fastest): the first n_chunks of each M tile make
        # one xa chunk each, before their own tile, so the epilogues (after a whole tile) rarely wait for it.
        chunk = pid_n + pid_k * tl.num_programs(0)
        if chunk < n_chunks:
            store_lora_down_chunk(lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_m, chunk, xa_chunk, M, K,
                                  R, stride_lxm, stride_an, USE_DOT, LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K,
                                  XA_MAX_CHUNKS, XA_COPIES, XA_COPY_STRIDE)  # fmt: skip

    # Software prefetch: the reads of tile i + 1 (weight codes, scales, x) are issued before tile i is decoded and
    # multiplied. (Triton's own pipeliner, num_stages > 1, would also stage the per-element code-table gathers
    # through shared memory; the FACTOR_SCALES path has none and may use it instead: LOAD_STAGES.) A prefetch past
    # k_end is fully masked and reads nothing.
    if SHUFFLE_LUT and WEIGHT_KIND == WEIGHT_4BIT_ALIGNED:  # int8 has no code table (its code_ptr is a stand-in)
        lane_entry = _lane_code_entry(code_ptr)
    else:
        lane_entry = tl.zeros((1, 1, 1, 1), tl.int32)
    if FACTOR_SCALES:
        # Here w_ptr holds int32 words and stride_wn counts words (small_m.py).
        x_row_ptr = x_ptr + pid_m * stride_xm
        if LOAD_STAGES == 1:
            words, raw_scale, x_cur = _load_words(w_ptr, absmax_ptr, x_row_ptr, offs_n, k_start, k_end, N, K,
                                                  stride_wn, BLOCKSIZE, SUB, BLOCK_K, PACKED_DOT)  # fmt: skip
        if PACKED_DOT:
            table = _permute_table(lane_entry)
            word_sums = tl.zeros((BLOCK_N, BLOCK_K // SUB, SUB // 8), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOAD_STAGES):
            if LOAD_STAGES > 1:  # Triton's pipeliner copies these tiles to shared memory, LOAD_STAGES - 1 ahead
                cur_words, cur_scale, cur_x = _load_words(w_ptr, absmax_ptr, x_row_ptr, offs_n, k0, k_end, N, K,
                                                          stride_wn, BLOCKSIZE, SUB, BLOCK_K, PACKED_DOT)  # fmt: skip
            else:
                cur_words, cur_scale, cur_x = words, raw_scale, x_cur
                words, raw_scale, x_cur = _load_words(w_ptr, absmax_ptr, x_row_ptr, offs_n, k0 + BLOCK_K, k_end, N,
                                                      K, stride_wn, BLOCKSIZE, SUB, BLOCK_K, PACKED_DOT)  # fmt: skip
            if PACKED_DOT:
                scale = _sub_block_scales(cur_scale, nested_code_ptr, nested_absmax_ptr, offset_ptr, offs_n, k0, k_end,
                                          N, K, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K // SUB, MUL_RN)
                word_sums += _packed_word_sums(cur_words, scale, cur_x, table)
            else:
                acc += _factored_row_dot(
                    cur_words, cur_scale, cur_x, lane_entry, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                    offs_n, k0, k_end, N, K, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K, MUL_RN, SHUFFLE_LUT,
                )[:, None]
        if PACKED_DOT:
            acc = tl.sum(tl.sum(word_sums, axis=2), axis=1)[:, None]
    else:
        packed, raw_scale = _load_weight_raw(
            w_ptr, absmax_ptr, offs_n, k_start, k_end, N, K, stride_wn, WEIGHT_KIND, BLOCKSIZE, SUB, BLOCK_N, BLOCK_K
        )
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_tile = _load_x_tile(x_ptr, offs_m, k_start, k_end, M, stride_xm, USE_DOT, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            w = _decode_weight_tile(packed, raw_scale, lane_entry, code_ptr, nested_code_ptr, nested_absmax_ptr,
                                    offset_ptr, offs_n, k0, k_end, N, K, WEIGHT_KIND, BLOCKSIZE, NESTED,
                                    NESTED_BLOCKSIZE, SUB, BLOCK_N, BLOCK_K, x_ty, INTERPRET, MUL_RN,
                                    SHUFFLE_LUT)  # fmt: skip
            x_cur = x_tile
            packed, raw_scale = _load_weight_raw(w_ptr, absmax_ptr, offs_n, k0 + BLOCK_K, k_end, N, K, stride_wn,
                                                 WEIGHT_KIND, BLOCKSIZE, SUB, BLOCK_N, BLOCK_K)  # fmt: skip
            x_tile = _load_x_tile(x_ptr, offs_m, k0 + BLOCK_K, k_end, M, stride_xm, USE_DOT, BLOCK_K)
            if USE_DOT:  # x_cur: (BLOCK_K, BLOCK_M)
                if DOT_FP32:
                    acc = tl.dot(w.to(tl.float32), x_cur.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, x_cur, acc)
            else:  # x_cur: (1, BLOCK_K). Reduced every tile: (BLOCK_N, BLOCK_K) partial sums would cost registers.
                acc += tl.sum(w.to(tl.float32) * x_cur.to(tl.float32), axis=1)[:, None]

    # Split-K: every program stores its partial sums; the last to arrive for a tile sums them all and finishes it.
    is_last = True
    if SPLIT_K > 1:
        tile_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tile_offs = offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + tile_offs, acc, mask=tile_mask)
        # Every thread's partial is written before one thread publishes the arrival (release, GPU scope)...
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel", scope="gpu")
        is_last = arrived == SPLIT_K - 1
        if is_last:
            # ...and the last program to arrive (acquire) sums all partials in split order, read from L2 (.cg).
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(partial_ptr + s * M * N + tile_offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
    if is_last:
        epilogue(acc, offs_n, offs_m, pid_n, pid_m, M, N, K, R, scaling, bias_ptr, lx_ptr, lora_a_ptr, lora_b_ptr,
                  xa_part_ptr, xa_count_ptr, out_ptr, n_chunks, xa_chunk, stride_lxm, stride_an, stride_bn, stride_om,
                  HAS_BIAS, HAS_LORA, USE_DOT, LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K, XA_MAX_CHUNKS, XA_COPIES,
                  XA_COPY_STRIDE, XA_POLLS, INTERPRET)  # fmt: skip
