"""Fused quantized linear + LoRA for a handful of rows (decoding): ``y = x @ W.T + b + s * (x_lora @ A.T) @ B.T``.

For M <= ~16 rows the cost is reading W, so one kernel streams the packed 4-bit (or int8) weight once, dequantizes
it in registers and never writes it back. Each program owns ``BLOCK_N`` output features of ``BLOCK_M`` rows and a
``K / SPLIT_K`` slice of the reduction:

    M == 1  CUDA cores: acc[n] += sum_k W_tile[n, k] * x[k] in fp32 (tensor cores would idle 15/16 of the MMA).
    M > 1   tensor cores on the swapped product: acc (BLOCK_N, BLOCK_M) += W_tile (BLOCK_N, BLOCK_K) @ x_tile.T,
            so the tiny M only has to fill the 16-wide side of the MMA.

The reads of the next tile (codes, scales, x) are issued before the current one is decoded (software prefetch), so
each program keeps two tiles of DRAM reads in flight without spending registers on decoded values.

With ``SPLIT_K > 1`` every program stores its fp32 partial sums in a workspace and bumps a per-tile counter; the
program that arrives last adds the partials in split order (deterministic) and runs the epilogue: bias, the LoRA
term ``(x_lora @ A.T) @ B.T`` and the cast to ``x.dtype``. No host syncs and data-independent allocations, so it can
be captured in a CUDA graph.

The LoRA down-projection ``xa = x_lora @ A.T`` (M x r, a few thousand MACs) is made inside the same launch instead
of as a separate matmul before it (6-7 us of a 15-40 us decode call on the H200). K is cut into at most 16 chunks;
the first programs of the grid (the first dispatched) each compute one chunk's fp32 partial of ``xa`` before their
own tile, store it and count it (release). An epilogue waits for the count (acquire) and sums the partials in one
fixed order (deterministic). Correctness never depends on the scheduler: an epilogue that does not see the full
count within a bounded number of polls (zero under the interpreter, which runs programs one after another) makes the
chunks itself with the same code, so the sum is the same bits either way.

Numerics follow ``reference.lora_linear_ref``: W is dequantized exactly as ``dequantize_4bit`` does and rounded to
``x.dtype`` before the multiply; sums are fp32 (in a different order than torch, hence the test tolerances). One
exception, ``SmallMConfig.factor_scales`` (M = 1, 4-bit rows of whole absmax blocks, the default there): each block's
``code * x`` products are summed first and scaled once, so W is never rounded to ``x.dtype`` (more accurate than the
reference; the tests bound it against the fp32 W).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2
from .dequant import (
    _INV_127,
    SUPPORTED_DTYPES,
    _cached,
    _decode_absmax,
    _decode_nibbles,
    _is_interpreted,
    _nested_args,
    _require_launchable,
    _round_to,
    check_int8,
    check_packed4bit,
)
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight
from .tuned import tuned_config, tuned_crossover

# Largest number of rows this path is meant for; the dispatcher (not this file) decides when to use it.
SMALL_M_MAX = 16

# xa = x_lora @ A.T is cut into at most this many K chunks, each made by one program (see the module docstring).
XA_MAX_CHUNKS = 16
# Counter polls (one L2 atomic each) before an epilogue makes the xa chunks itself. The producers are the first
# programs dispatched, so on a GPU the count is normally complete at the first poll; the bound only guarantees
# progress whatever the scheduler does.
XA_POLLS = 1 << 14
# Each M tile's chunk counter is kept in this many copies, one 128-byte line apart: the epilogues of different
# N tiles poll different copies instead of all one address.
XA_COPIES, XA_COPY_STRIDE = 8, 32

# How the kernel reads W. ALIGNED: 4-bit with rows made of whole absmax blocks (K % blocksize == 0, every real
# model), loaded as (BLOCK_N, sub-blocks, bytes) so one scale serves a run of bytes. ANY: 4-bit of any shape, one
# gather per element. INT8: row-scaled int8.
_KIND_4BIT_ALIGNED, _KIND_4BIT_ANY, _KIND_INT8 = 0, 1, 2


@dataclass(frozen=True)
class SmallMConfig:
    """Tiling of one launch. ``use_dot``: tensor-core path (``BLOCK_M = 16``) instead of FMAs (``BLOCK_M = 1``)."""

    use_dot: bool
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    # 1 = no software pipelining: with more stages Triton's pipeliner also routes the per-element code-table
    # gathers through shared memory (cp.async), which costs more than the latency it hides here.
    num_stages: int = 1
    # M = 1 with 4-bit rows of whole absmax blocks: sum code * x over each block, then multiply by the block's scale
    # once (instead of scaling and rounding every weight). About half the instructions per weight; W is then not
    # rounded to x.dtype before the multiply (more accurate than the reference, within the same tolerances).
    factor_scales: bool = True

    def __post_init__(self) -> None:
        # Tuned configs may come from a user's JSON file (tuned.py): reject what the kernel cannot tile.
        for name, low in (("block_n", 1), ("block_k", 16), ("num_warps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"SmallMConfig `{name}` must be a power of two >= {low}, got {value!r}.")
        for name in ("split_k", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SmallMConfig `{name}` must be an int >= 1, got {value!r}.")


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
    if WEIGHT_KIND == 0:
        sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB  # (NB,) first element of each sub-block
        byte_in_row = (sub_start // 2)[:, None] + tl.arange(0, SUB // 2)[None, :]  # (NB, SUB/2)
        mask = mask_n[:, None, None] & (byte_in_row < k_end // 2)[None, :, :]
        packed = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte_in_row[None, :, :], mask=mask, other=0)
        block_idx = rows[:, None] * (K // BLOCKSIZE) + (sub_start // BLOCKSIZE)[None, :]  # (BLOCK_N, NB)
        raw_scale = tl.load(absmax_ptr + block_idx, mask=mask_n[:, None] & (sub_start < k_end)[None, :], other=0)
    elif WEIGHT_KIND == 1:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        idx = rows[:, None] * K + offs_k[None, :]  # element index in the flattened weight
        packed = tl.load(w_ptr + idx // 2, mask=mask, other=0)
        raw_scale = tl.load(absmax_ptr + idx // BLOCKSIZE, mask=mask, other=0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        raw_scale = tl.load(absmax_ptr + offs_n, mask=mask_n, other=0.0)
    return packed, raw_scale


@triton.jit
def _decode_weight_tile(
    packed,
    raw_scale,
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
):
    """The (BLOCK_N, BLOCK_K) tile from ``_load_weight_raw``, dequantized exactly and rounded to ``DTYPE``."""
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    if WEIGHT_KIND == 0:
        sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
        block_idx = rows[:, None] * (K // BLOCKSIZE) + (sub_start // BLOCKSIZE)[None, :]
        scale_mask = mask_n[:, None] & (sub_start < k_end)[None, :]
        scale = _decode_absmax(
            raw_scale, block_idx, scale_mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE,
            MUL_RN,
        )[:, :, None]
        high, low = _decode_nibbles(packed, code_ptr)
        w = tl.interleave(_round_to(high * scale, DTYPE, INTERPRET), _round_to(low * scale, DTYPE, INTERPRET))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # (BLOCK_N, NB, SUB) -> (BLOCK_N, BLOCK_K)
    elif WEIGHT_KIND == 1:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (offs_k < k_end)[None, :]
        idx = rows[:, None] * K + offs_k[None, :]
        shift = (4 - (idx % 2) * 4).to(tl.int32)  # even element: high nibble
        value = tl.load(code_ptr + ((packed.to(tl.int32) >> shift) & 0xF))
        scale = _decode_absmax(
            raw_scale, idx // BLOCKSIZE, mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE,
            MUL_RN,
        )
        w = _round_to(value * scale, DTYPE, INTERPRET)
    else:
        w = _round_to(packed.to(tl.float32) * raw_scale[:, None] * _INV_127, DTYPE, INTERPRET)
    return w


@triton.jit
def _load_x_pairs(x_row_ptr, k0, k_end, SUB: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's x[k0 : k0 + BLOCK_K] as (even, odd) elements of each sub-block: two (BLOCK_K / SUB, SUB / 2) tiles
    laid out like the high / low nibbles of the packed bytes."""
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    even = sub_start[:, None] + 2 * tl.arange(0, SUB // 2)[None, :]
    x_even = tl.load(x_row_ptr + even, mask=even < k_end, other=0.0)
    x_odd = tl.load(x_row_ptr + even + 1, mask=even + 1 < k_end, other=0.0)
    return x_even.to(tl.float32), x_odd.to(tl.float32)


@triton.jit
def _factored_row_dot(
    packed,  # (BLOCK_N, NB, SUB / 2) uint8, from _load_weight_raw (ALIGNED)
    raw_scale,  # (BLOCK_N, NB)
    x_even,  # (NB, SUB / 2) fp32
    x_odd,
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
):
    """(BLOCK_N,) fp32: sum_k W[n, k] * x[k] over the tile as sum_blocks scale[n, b] * sum_{k in b} code[n, k] * x[k].

    One code lookup and one FMA per weight; the scale multiply happens once per sub-block of SUB weights.
    """
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    block_idx = rows[:, None] * (K // BLOCKSIZE) + (sub_start // BLOCKSIZE)[None, :]
    scale_mask = mask_n[:, None] & (sub_start < k_end)[None, :]
    scale = _decode_absmax(
        raw_scale, block_idx, scale_mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE,
        MUL_RN,
    )  # (BLOCK_N, NB)
    high, low = _decode_nibbles(packed, code_ptr)  # codes of the even / odd elements, (BLOCK_N, NB, SUB / 2)
    per_block = tl.sum(high * x_even[None, :, :] + low * x_odd[None, :, :], axis=2)  # (BLOCK_N, NB)
    return tl.sum(per_block * scale, axis=1)


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
def _epilogue(
    acc,  # (BLOCK_N, BLOCK_M) fp32: (x @ W.T).T for this tile
    offs_n,
    offs_m,
    M,
    N,
    R,
    scaling,
    bias_ptr,
    xa,  # x_lora @ A.T in the adapter dtype: (BLOCK_R, BLOCK_M) for the MMA path, (1, BLOCK_R) for M = 1
    lora_b_ptr,  # (N, R)
    out_ptr,  # (M, N)
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    LORA_DOT_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[m, n] = acc + bias (rounded to x.dtype) + scaling * xa[m] @ B[n] (fp32), stored in x.dtype."""
    out_ty = out_ptr.dtype.element_ty
    mask_n = offs_n < N
    mask_m = offs_m < M
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += _round_to(bias, out_ty, INTERPRET).to(tl.float32)[:, None]
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        b_ptrs = lora_b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :]
        b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
        b = b.to(xa.dtype)  # the reference casts B to the adapter (A) dtype
        if USE_DOT:  # xa: (BLOCK_R, BLOCK_M)
            if LORA_DOT_FP32:
                lora = tl.dot(b.to(tl.float32), xa.to(tl.float32), input_precision="ieee")
            else:
                lora = tl.dot(b, xa)
        else:  # xa: (1, BLOCK_R)
            lora = tl.sum(b.to(tl.float32) * xa.to(tl.float32), axis=1)[:, None]
        acc += lora * scaling
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, _round_to(acc, out_ty, INTERPRET), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _lora_down_chunk(
    lx_ptr,  # (M, K) LoRA input rows, unit stride along K
    lora_a_ptr,  # (R, K)
    offs_m,
    k_lo,
    k_hi,
    M,
    R,
    stride_lxm,
    stride_an,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
):
    """fp32 partial of xa = x_lora.to(A.dtype) @ A.T over x_lora[:, k_lo : k_hi]: (BLOCK_R, BLOCK_M) for the MMA
    path (xa transposed, as the epilogue's dot takes it), (1, BLOCK_R) for M = 1."""
    a_ty = lora_a_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if USE_DOT:
        part = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    else:
        part = tl.zeros((1, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, XA_BLOCK_K):
        offs_k = k0 + tl.arange(0, XA_BLOCK_K)
        mask_k = offs_k < k_hi
        a = tl.load(lora_a_ptr + offs_r[:, None] * stride_an + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                    other=0.0)  # (BLOCK_R, XA_BLOCK_K)  # fmt: skip
        if USE_DOT:
            x_t = tl.load(lx_ptr + offs_m[None, :] * stride_lxm + offs_k[:, None],
                          mask=mask_k[:, None] & (offs_m < M)[None, :], other=0.0)  # fmt: skip
            x_t = x_t.to(a_ty)  # (XA_BLOCK_K, BLOCK_M), rounded to the adapter dtype like the reference
            if DOT_FP32:
                part = tl.dot(a.to(tl.float32), x_t.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(a, x_t, part)
        else:
            x = tl.load(lx_ptr + offs_m[:, None] * stride_lxm + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            x = x.to(a_ty).to(tl.float32)  # (1, XA_BLOCK_K)
            part += tl.sum(a.to(tl.float32) * x, axis=1)[None, :]
    return part


@triton.jit
def _chunk_tile_offsets(USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Offsets of one chunk partial's elements inside its (BLOCK_R * BLOCK_M) slot of the workspace."""
    if USE_DOT:
        offs = tl.arange(0, BLOCK_R)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        offs = tl.arange(0, BLOCK_R)[None, :]
    return offs


@triton.jit
def _lora_down(
    lx_ptr,
    lora_a_ptr,
    xa_part_ptr,  # (m tiles, XA_MAX_CHUNKS, BLOCK_R * BLOCK_M) fp32 chunk partials
    xa_count_ptr,  # (m tiles, XA_COPIES, XA_COPY_STRIDE) int32 zeros: chunks stored so far, in XA_COPIES copies
    offs_m,
    pid_n,
    pid_m,
    n_chunks,
    xa_chunk,
    M,
    K,
    R,
    stride_lxm,
    stride_an,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
    XA_MAX_CHUNKS: tl.constexpr,
    XA_COPIES: tl.constexpr,
    XA_COPY_STRIDE: tl.constexpr,
    XA_POLLS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """xa = x_lora @ A.T for this program's rows, in the adapter dtype: the chunk partials summed in one fixed order.

    Waits (``XA_POLLS`` polls at most) until the producers have stored every chunk; if they have not, makes every
    chunk here and stores it into the same slots (the same code gives the same bits, so a slot a producer writes
    too holds the same value), then sums as usual. The counter polled is one of ``XA_COPIES`` copies (by tile), so
    that the epilogues of many tiles do not all hit one address.
    """
    count_ptr = xa_count_ptr + (pid_m * XA_COPIES + pid_n % XA_COPIES) * XA_COPY_STRIDE
    done = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (done < n_chunks) & (polls < XA_POLLS):
        done = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    slots = xa_part_ptr + pid_m * (XA_MAX_CHUNKS * BLOCK_R * BLOCK_M)
    offs = _chunk_tile_offsets(USE_DOT, BLOCK_M, BLOCK_R)
    if done < n_chunks:
        for c in range(0, n_chunks):
            k_lo = c * xa_chunk
            part = _lora_down_chunk(lx_ptr, lora_a_ptr, offs_m, k_lo, tl.minimum(k_lo + xa_chunk, K), M, R,
                                    stride_lxm, stride_an, USE_DOT, DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K)  # fmt: skip
            tl.store(slots + c * (BLOCK_R * BLOCK_M) + offs, part)
        tl.debug_barrier()
    # All chunk partials in one load, read from L2 (.cg), not a stale L1 line; missing chunks read as 0.
    chunks = tl.arange(0, XA_MAX_CHUNKS)
    if USE_DOT:
        ptrs = slots + chunks[:, None, None] * (BLOCK_R * BLOCK_M) + offs[None, :, :]
        parts = tl.load(ptrs, mask=(chunks < n_chunks)[:, None, None], other=0.0, cache_modifier=".cg")
        xa = tl.sum(parts, axis=0)  # (BLOCK_R, BLOCK_M)
    else:
        ptrs = slots + chunks[:, None] * (BLOCK_R * BLOCK_M) + tl.arange(0, BLOCK_R)[None, :]
        parts = tl.load(ptrs, mask=(chunks < n_chunks)[:, None], other=0.0, cache_modifier=".cg")
        xa = tl.sum(parts, axis=0)[None, :]  # (1, BLOCK_R)
    return _round_to(xa, lora_a_ptr.dtype.element_ty, INTERPRET)


@triton.jit
def _lora_down_if(
    lx_ptr,
    lora_a_ptr,
    xa_part_ptr,
    xa_count_ptr,
    offs_m,
    pid_n,
    pid_m,
    n_chunks,
    xa_chunk,
    M,
    K,
    R,
    stride_lxm,
    stride_an,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
    XA_MAX_CHUNKS: tl.constexpr,
    XA_COPIES: tl.constexpr,
    XA_COPY_STRIDE: tl.constexpr,
    XA_POLLS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """[`_lora_down`] when there is a LoRA term; else a placeholder the epilogue never reads."""
    if HAS_LORA:
        xa = _lora_down(lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_n, pid_m, n_chunks, xa_chunk, M,
                        K, R, stride_lxm, stride_an, USE_DOT, DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K, XA_MAX_CHUNKS,
                        XA_COPIES, XA_COPY_STRIDE, XA_POLLS, INTERPRET)  # fmt: skip
    else:
        xa = tl.zeros((1, BLOCK_R), dtype=tl.float32)
    return xa


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
    FACTOR_SCALES: tl.constexpr,  # M = 1, ALIGNED 4-bit: scale applied per sub-block (see _factored_row_dot)
    MUL_RN: tl.constexpr,  # exact nested-absmax decode with fp fusion on (compiled kernels; see _decode_absmax)
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
            k_lo = chunk * xa_chunk
            k_hi = tl.minimum(k_lo + xa_chunk, K)
            part = _lora_down_chunk(lx_ptr, lora_a_ptr, offs_m, k_lo, k_hi, M, R, stride_lxm, stride_an, USE_DOT,
                                    LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K)  # fmt: skip
            slot = (pid_m * XA_MAX_CHUNKS + chunk) * (BLOCK_R * BLOCK_M)
            tl.store(xa_part_ptr + slot + _chunk_tile_offsets(USE_DOT, BLOCK_M, BLOCK_R), part)
            # Every thread's store is done before one thread counts the chunk (release, GPU scope), in every copy.
            tl.debug_barrier()
            for copy in tl.static_range(XA_COPIES):
                count_ptr = xa_count_ptr + (pid_m * XA_COPIES + copy) * XA_COPY_STRIDE
                tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")

    # Software prefetch: the reads of tile i + 1 (weight codes, scales, x) are issued before tile i is decoded and
    # multiplied. (Triton's own pipeliner, num_stages > 1, would also stage the per-element code-table gathers
    # through shared memory.) A prefetch past k_end is fully masked and reads nothing.
    packed, raw_scale = _load_weight_raw(
        w_ptr, absmax_ptr, offs_n, k_start, k_end, N, K, stride_wn, WEIGHT_KIND, BLOCKSIZE, SUB, BLOCK_N, BLOCK_K
    )
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if FACTOR_SCALES:
        x_row_ptr = x_ptr + pid_m * stride_xm
        x_even, x_odd = _load_x_pairs(x_row_ptr, k_start, k_end, SUB, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            cur_packed, cur_scale, cur_even, cur_odd = packed, raw_scale, x_even, x_odd
            packed, raw_scale = _load_weight_raw(
                w_ptr, absmax_ptr, offs_n, k0 + BLOCK_K, k_end, N, K, stride_wn, WEIGHT_KIND, BLOCKSIZE, SUB, BLOCK_N,
                BLOCK_K,
            )
            x_even, x_odd = _load_x_pairs(x_row_ptr, k0 + BLOCK_K, k_end, SUB, BLOCK_K)
            acc += _factored_row_dot(
                cur_packed, cur_scale, cur_even, cur_odd, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                offs_n, k0, k_end, N, K, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K, MUL_RN,
            )[:, None]
    else:
        x_tile = _load_x_tile(x_ptr, offs_m, k_start, k_end, M, stride_xm, USE_DOT, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            w = _decode_weight_tile(
                packed,
                raw_scale,
                code_ptr,
                nested_code_ptr,
                nested_absmax_ptr,
                offset_ptr,
                offs_n,
                k0,
                k_end,
                N,
                K,
                WEIGHT_KIND,
                BLOCKSIZE,
                NESTED,
                NESTED_BLOCKSIZE,
                SUB,
                BLOCK_N,
                BLOCK_K,
                x_ty,
                INTERPRET,
                MUL_RN,
            )
            x_cur = x_tile
            packed, raw_scale = _load_weight_raw(
                w_ptr,
                absmax_ptr,
                offs_n,
                k0 + BLOCK_K,
                k_end,
                N,
                K,
                stride_wn,
                WEIGHT_KIND,
                BLOCKSIZE,
                SUB,
                BLOCK_N,
                BLOCK_K,
            )
            x_tile = _load_x_tile(x_ptr, offs_m, k0 + BLOCK_K, k_end, M, stride_xm, USE_DOT, BLOCK_K)
            if USE_DOT:  # x_cur: (BLOCK_K, BLOCK_M)
                if DOT_FP32:
                    acc = tl.dot(w.to(tl.float32), x_cur.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, x_cur, acc)
            else:  # x_cur: (1, BLOCK_K). Reduced every tile: (BLOCK_N, BLOCK_K) partial sums would cost registers.
                acc += tl.sum(w.to(tl.float32) * x_cur.to(tl.float32), axis=1)[:, None]

    if SPLIT_K == 1:
        xa = _lora_down_if(
            lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_n, pid_m, n_chunks, xa_chunk, M, K, R,
            stride_lxm, stride_an, HAS_LORA, USE_DOT, LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K, XA_MAX_CHUNKS,
            XA_COPIES, XA_COPY_STRIDE, XA_POLLS, INTERPRET,
        )
        _epilogue(
            acc,
            offs_n,
            offs_m,
            M,
            N,
            R,
            scaling,
            bias_ptr,
            xa,
            lora_b_ptr,
            out_ptr,
            stride_bn,
            stride_om,
            HAS_BIAS,
            HAS_LORA,
            USE_DOT,
            LORA_DOT_FP32,
            BLOCK_R,
            INTERPRET,
        )
    else:
        tile_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tile_offs = offs_m[None, :] * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + tile_offs, acc, mask=tile_mask)
        # Every thread's partial is written before one thread publishes the arrival (release, GPU scope)...
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # ...and the last program to arrive (acquire) sums all partials in split order, read from L2 (.cg).
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * M * N + tile_offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
            xa = _lora_down_if(
                lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_n, pid_m, n_chunks, xa_chunk, M, K, R,
                stride_lxm, stride_an, HAS_LORA, USE_DOT, LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K, XA_MAX_CHUNKS,
                XA_COPIES, XA_COPY_STRIDE, XA_POLLS, INTERPRET,
            )
            _epilogue(
                total,
                offs_n,
                offs_m,
                M,
                N,
                R,
                scaling,
                bias_ptr,
                xa,
                lora_b_ptr,
                out_ptr,
                stride_bn,
                stride_om,
                HAS_BIAS,
                HAS_LORA,
                USE_DOT,
                LORA_DOT_FP32,
                BLOCK_R,
                INTERPRET,
            )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def weight_kind(weight: QuantizedWeight) -> str:
    """``"int8"`` or ``"nf4"`` (every 4-bit weight): the key of the tuning tables (``tuned.py``)."""
    return "int8" if isinstance(weight, Int8Rowwise) else "nf4"


def small_m_limit(weight: QuantizedWeight, device: torch.device) -> int:
    """Most rows for which the dispatcher picks this kernel: the measured crossover if tabled, else ``SMALL_M_MAX``."""
    n, k = weight.shape
    return _small_m_limit(device, weight_kind(weight), n, k)


# A constant for torch.compile: dynamo cannot trace the table lookup (torch.cuda.get_device_name returns a str), so
# it calls this at trace time. (Marking the lru_cache wrapper itself is not honoured by torch 2.11's dynamo.)
@torch.compiler.assume_constant_result
def _small_m_limit(device: torch.device, kind: str, n: int, k: int) -> int:
    return _small_m_limit_cached(device, kind, n, k)


@functools.lru_cache(maxsize=1024)
def _small_m_limit_cached(device: torch.device, kind: str, n: int, k: int) -> int:
    crossover = tuned_crossover(device, kind, n, k)
    return SMALL_M_MAX if crossover is None else crossover


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, device: torch.device, kind: str = "nf4") -> SmallMConfig:
    """The tiling for ``m`` rows of an ``(n, k)`` weight: measured (``tuned.py``) when tabled, else a heuristic.

    Memoized: the dispatcher calls it on every decode step.
    """
    tuned = tuned_config(device, kind, m, n, k)
    if tuned is not None:
        return SmallMConfig(**tuned)
    return heuristic_config(m, n, k, device)


def heuristic_config(m: int, n: int, k: int, device: torch.device) -> SmallMConfig:
    """Default tiling: FMAs for one row, tensor cores otherwise; K is split until there are ~6 programs per SM.

    The tiles keep registers below ~100 per thread so that several programs share an SM: with the prefetch, the
    bytes in flight (what bounds a weight-streaming kernel) grow with the number of resident programs.
    """
    if m == 1:
        block_m, block_n, block_k = 1, 8, 512
    else:
        block_m, block_n, block_k = 16, 32, 128
    block_k = min(block_k, max(16, next_power_of_2(k)))
    if device.type != "cuda":  # the interpreter: fewest programs is fastest
        return SmallMConfig(use_dot=m > 1, block_n=min(block_n, max(16, next_power_of_2(n))), block_k=block_k)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    k_tiles = cdiv(k, block_k)
    split_k = max(1, min(cdiv(6 * _sm_count(device.index or 0), tiles), k_tiles, 16))
    return SmallMConfig(use_dot=m > 1, block_n=block_n, block_k=block_k, split_k=split_k)


def _check_inputs(x, weight, bias, lora_a, lora_b, lora_x) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"`x` must have dtype in {SUPPORTED_DTYPES}, got {x.dtype!r}; cast the activations first.")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"`x` must have shape (..., {k}) to match the weight {tuple(weight.shape)}, got {tuple(x.shape)}."
        )
    device = weight.device
    for name, t in (("x", x), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b), ("lora_x", lora_x)):
        if t is not None and t.device != device:
            raise ValueError(f"`{name}` is on {t.device} but the weight is on {device}; move it to {device}.")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"`bias` must have shape ({n},), got {tuple(bias.shape)}.")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("`lora_a` and `lora_b` must be given together (or both be None to skip the LoRA term).")
    if lora_a is not None:
        r = lora_a.shape[0]
        if lora_a.dim() != 2 or lora_a.shape[1] != k:
            raise ValueError(f"`lora_a` must have shape (r, {k}), got {tuple(lora_a.shape)}.")
        if tuple(lora_b.shape) != (n, r):
            raise ValueError(f"`lora_b` must have shape ({n}, {r}) to match `lora_a`, got {tuple(lora_b.shape)}.")
        if lora_a.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`lora_a` must have dtype in {SUPPORTED_DTYPES}, got {lora_a.dtype!r}.")
    if lora_x is not None and lora_x.shape != x.shape:
        raise ValueError(f"`lora_x` must have the shape of `x` {tuple(x.shape)}, got {tuple(lora_x.shape)}.")


def _weight_args(weight: QuantizedWeight, block_k: int) -> tuple[tuple, tuple]:
    """Kernel pointer arguments and constexprs (WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB) of ``weight``.

    Checked once per container and ``block_k`` (memoized on it, like the dequant launch plans).
    """
    if isinstance(weight, Int8Rowwise):
        key = ("small_m", block_k, weight.cb.data_ptr(), weight.scb.data_ptr())
    elif isinstance(weight, Packed4bit):
        key = ("small_m", block_k, weight.data.data_ptr(), weight.absmax.data_ptr())
    else:
        raise TypeError(f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}.")
    return _cached(weight, key, lambda: _build_weight_args(weight, block_k))


def _build_weight_args(weight: QuantizedWeight, block_k: int) -> tuple[tuple, tuple]:
    if isinstance(weight, Int8Rowwise):
        check_int8(weight)
        cb = weight.cb
        meta = (_KIND_INT8, 1, False, 1, block_k)  # WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB
        return (cb, weight.scb, weight.scb, weight.scb, weight.scb, weight.scb, cb.stride(0)), meta
    data = check_packed4bit(weight)
    k, bs = weight.shape[1], weight.blocksize
    kind = _KIND_4BIT_ALIGNED if k % bs == 0 else _KIND_4BIT_ANY
    nested_code, nested_absmax, offset, nested_bs = _nested_args(weight)
    meta = (kind, bs, weight.nested, nested_bs, min(bs, block_k))
    return (data, weight.absmax, weight.code, nested_code, nested_absmax, offset, k // 2), meta


def _xa_chunking(k: int, programs_per_m_tile: int) -> tuple[int, int, int]:
    """(XA_BLOCK_K, chunk, n_chunks) of ``xa = x_lora @ A.T``: at most ``XA_MAX_CHUNKS`` chunks and no more than the
    programs that make them; ``chunk`` is a multiple of ``XA_BLOCK_K``."""
    xa_block_k = min(128, max(16, next_power_of_2(k)))
    wanted = min(XA_MAX_CHUNKS, programs_per_m_tile)
    chunk = max(xa_block_k, next_power_of_2(cdiv(k, wanted)))
    return xa_block_k, chunk, cdiv(k, chunk)


@dataclass(frozen=True)
class _LaunchPlan:
    """Everything of a launch that depends on sizes and tiling only (memoized: decode calls it every layer call)."""

    grid: tuple[int, int, int]
    k_per_split: int
    split_k: int
    block_m: int
    block_r: int
    xa_block_k: int
    xa_chunk: int
    n_chunks: int
    n_partials: int  # fp32 split-K partials (0: no split)
    n_xa_parts: int  # fp32 xa chunk partials (0: no LoRA term)
    n_arrivals: int  # int32 zeros: split-K arrivals, then the xa chunk counters
    n_xa_counts: int


@functools.lru_cache(maxsize=4096)
def _launch_plan(m: int, n: int, k: int, config: SmallMConfig, r: Optional[int]) -> _LaunchPlan:
    """``r``: the LoRA rank, or None for no LoRA term."""
    has_lora = r is not None
    block_m = 16 if config.use_dot else 1
    block_n, block_k = config.block_n, config.block_k
    k_per_split = cdiv(cdiv(k, block_k), config.split_k) * block_k
    split_k = cdiv(k, k_per_split)  # no empty splits
    grid = (cdiv(n, block_n), split_k, cdiv(m, block_m))
    block_r = max(16, next_power_of_2(r or 0))
    xa_block_k, xa_chunk, n_chunks = _xa_chunking(k, grid[0] * grid[1]) if has_lora else (16, k, 0)
    n_partials = split_k * m * n if split_k > 1 else 0
    n_arrivals = grid[0] * grid[2] if split_k > 1 else 0
    return _LaunchPlan(
        grid=grid,
        k_per_split=k_per_split,
        split_k=split_k,
        block_m=block_m,
        block_r=block_r,
        xa_block_k=xa_block_k,
        xa_chunk=xa_chunk,
        n_chunks=n_chunks,
        n_partials=n_partials,
        n_xa_parts=grid[2] * XA_MAX_CHUNKS * block_r * block_m if has_lora else 0,
        n_arrivals=n_arrivals,
        n_xa_counts=grid[2] * XA_COPIES * XA_COPY_STRIDE if has_lora else 0,
    )


def _launch(
    x2d: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_x2d: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    config: SmallMConfig,
) -> torch.Tensor:
    """Runs the kernel on (M, K) rows with an explicit tiling.

    ``lora_x2d``: the LoRA branch's (M, K) input rows (``x2d`` itself when there is no separate one), unit stride
    along K; ``lora_a``/``lora_b`` contiguous, or both ``None``.
    """
    m, k = x2d.shape
    n = weight.shape[0]
    device = x2d.device
    out = torch.empty((m, n), dtype=x2d.dtype, device=device)
    if m == 0:
        return out
    has_lora = lora_a is not None
    r = lora_a.shape[0] if has_lora else 0
    plan = _launch_plan(m, n, k, config, r if has_lora else None)
    # One zeroed int32 buffer (one memset) holds the split-K arrival counters and the xa chunk counters. (One fp32
    # workspace for both kinds of partials, with offsets, measured up to 2.5 us slower on some tilings: the kernel
    # takes separate pointers.)
    n_counters = plan.n_arrivals + plan.n_xa_counts
    counters = torch.zeros(n_counters, dtype=torch.int32, device=device) if n_counters else out
    arrivals = counters[: plan.n_arrivals] if plan.n_arrivals else out
    xa_count = (counters[plan.n_arrivals :] if plan.n_arrivals else counters) if plan.n_xa_counts else out
    partial = torch.empty(plan.n_partials, dtype=torch.float32, device=device) if plan.n_partials else out
    xa_part = torch.empty(plan.n_xa_parts, dtype=torch.float32, device=device) if plan.n_xa_parts else out
    w_args, w_meta = _weight_args(weight, config.block_k)
    interpret = _is_interpreted(_fused_small_m_kernel)
    _require_launchable(device)
    args = (
        x2d,
        *w_args[:6],
        bias if bias is not None else out,
        lora_x2d if has_lora else out,
        lora_a if has_lora else out,
        lora_b if has_lora else out,
        out,
        partial,
        arrivals,
        xa_part,
        xa_count,
        m,
        n,
        k,
        r,
        float(scaling),
        x2d.stride(0),
        w_args[6],
        lora_x2d.stride(0) if has_lora else 0,
        lora_a.stride(0) if has_lora else 0,
        lora_b.stride(0) if has_lora else 0,
        out.stride(0),
        plan.k_per_split,
        plan.n_chunks,
        plan.xa_chunk,
        *w_meta,  # WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB
        bias is not None,  # HAS_BIAS
        has_lora,  # HAS_LORA
        config.use_dot,  # USE_DOT
        interpret or x2d.dtype == torch.float32,  # DOT_FP32
        interpret or (has_lora and lora_a.dtype == torch.float32),  # LORA_DOT_FP32
        plan.block_m,
        config.block_n,
        config.block_k,
        plan.block_r,
        plan.split_k,
        plan.xa_block_k,
        XA_MAX_CHUNKS,
        XA_COPIES,
        XA_COPY_STRIDE,
        0 if interpret else XA_POLLS,  # the interpreter runs programs one by one: an incomplete count stays so
        interpret,
        config.factor_scales and not config.use_dot and w_meta[0] == _KIND_4BIT_ALIGNED,  # FACTOR_SCALES
        not interpret,  # MUL_RN
    )
    # fp fusion stays on (FMAs in the dot products): the only sums that must not fuse, in the nested-absmax decode,
    # use mul.rn (MUL_RN). The interpreter computes exactly as written.
    launch(_fused_small_m_kernel, plan.grid, args, device, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def fused_lora_linear_small_m(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inference forward of a quantized linear layer with a LoRA adapter, for few rows (see [`lora_linear_ref`]).

    Reads the quantized weight once and never materializes it; meant for ``x`` with at most about
    [`SMALL_M_MAX`] rows (any M is correct, but the weight is re-read for every 16 rows).

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32; W is rounded to this dtype.
        weight ([`Packed4bit`] or [`Int8Rowwise`]): The quantized base weight ``(out_features, in_features)``.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``, rounded to ``x.dtype``.
        lora_a (`torch.Tensor`, *optional*): ``(r, in_features)`` LoRA down-projection; ``None`` skips LoRA.
        lora_b (`torch.Tensor`, *optional*): ``(out_features, r)`` LoRA up-projection (used in ``lora_a``'s dtype).
        scaling (`float`): LoRA scaling (``alpha / r``).
        lora_x (`torch.Tensor`, *optional*): Input of the LoRA branch (e.g. after dropout), shaped like ``x``.

    Returns:
        `torch.Tensor`: ``(..., out_features)`` in ``x.dtype``.
    """
    _check_inputs(x, weight, bias, lora_a, lora_b, lora_x)
    return small_m_forward(x, weight, bias, lora_a, lora_b, scaling, lora_x)


def small_m_forward(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[`fused_lora_linear_small_m`] without the argument checks, for callers that checked already (the dispatcher)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    lx2d = None
    if lora_a is not None:
        lx2d = x2d if lora_x is None else lora_x.reshape(-1, k)
        if lx2d.stride(-1) != 1:
            lx2d = lx2d.contiguous()
        if not lora_a.is_contiguous():
            lora_a = lora_a.contiguous()
        if not lora_b.is_contiguous():
            lora_b = lora_b.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    config = pick_config(x2d.shape[0], n, k, x.device, weight_kind(weight))
    out = _launch(x2d, weight, bias, lx2d, lora_a, lora_b, scaling, config)
    return out.reshape(*lead, n)
