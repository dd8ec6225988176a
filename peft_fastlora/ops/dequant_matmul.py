"""Quantized matmuls that dequantize W inside the GEMM (the large-M, training/prefill experiment of issue #3).

Two products of activations with a quantized weight W ``(N, K)`` (4-bit NF4/FP4 or row-scaled int8), never writing
the dequantized W to memory:

    forward   y  (M, N) = x (M, K) @ dequant(W).T (+ bias)     [`dequant_matmul`]
    backward  dx (M, K) = g (M, N) @ dequant(W)                [`dequant_matmul_t`]

One kernel does both. It is Triton tutorial 03 in generic GEMM terms, ``out (M, P) = a (M, R) @ b (R, P)``, where b is
W.T (forward: P = N, R = K) or W (backward: P = K, R = N); programs are grouped GROUP_M tiles at a time along M so the
W tiles they decode stay in L2. Each program owns an output tile (BLOCK_M, BLOCK_N) and walks R in steps of BLOCK_K:
it loads the packed bytes of the W tile, decodes them in registers exactly like ``dequant.py`` (fp32 math, one
rounding to ``a.dtype``), and accumulates ``a_tile @ b_tile`` in fp32 on the tensor cores. So the result is
``a @ dequant(W).to(a.dtype)`` with fp32 accumulation, rounded once to ``a.dtype`` (bias added before that rounding).

``swap_ab`` computes the transposed tile instead, ``out.T (BLOCK_N, BLOCK_M) = b.T @ a.T``: the decoded W tile is then
the left MMA operand, which Hopper's wgmma can read straight from registers (the right operand must sit in shared
memory, so with W on the right every decoded tile makes a trip through shared memory).

Layouts. 4-bit rows made of whole absmax blocks (``K % blocksize == 0``, blocksize >= 16: every real model) read the
tile as (rows, sub-blocks, bytes), one scale per sub-block. Any other 4-bit layout (odd K, rows starting mid-block)
takes a per-element path: correct, but slow; it is there so no weight ever needs a fallback. int8: one scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import _is_interpreted, launch
from .dequant import (
    _INV_127,
    SUPPORTED_DTYPES,
    _cached,
    _load_absmax,
    _nested_args,
    _require_launchable,
    _round_to,
    check_int8,
    check_packed4bit,
)
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight

# How the kernel reads W (see the module docstring).
_KIND_4BIT_ALIGNED, _KIND_4BIT_ANY, _KIND_INT8 = 0, 1, 2
_MIN_ALIGNED_BLOCKSIZE = 16  # the (rows, sub-blocks, bytes) tile needs >= 8 bytes per sub-block to vectorize


@dataclass(frozen=True)
class DequantMatmulConfig:
    """Tiling of one launch, in GEMM terms ``out (M, P) = a (M, R) @ b (R, P)``.

    ``block_m`` rows of ``a``/``out``; ``block_n`` columns of ``out`` (forward: output features; backward: input
    features); ``block_k`` reduction step. ``group_m``: programs that walk down M together over one W column strip.
    ``swap_ab``: compute ``out.T`` so the decoded W is the register (left) MMA operand. ``lut_asm``: read the 4-bit
    code table with an opaque ``ld.global.nc`` (see ``_code_values``; ignored by the interpreter).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    swap_ab: bool = True
    num_warps: int = 8
    num_stages: int = 3
    lut_asm: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "group_m"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"`{name}` must be a power of two, got {value}.")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"`{name}` must be >= 16 (the smallest tl.dot tile), got {getattr(self, name)}.")


@triton.jit
def _code_values(code_ptr, nibble, LUT_ASM: tl.constexpr):
    """``code[nibble]`` in fp32 (``nibble``: int32 tensor in [0, 16)).

    With num_stages > 1 Triton's pipeliner stages every table gather of ``tl.load`` through shared memory (cp.async,
    32 KB per stage for a 128 x 64 tile). ``LUT_ASM`` hides the load from it: read in the loop, from L1.
    """
    if LUT_ASM:
        values = tl.inline_asm_elementwise(
            "ld.global.nc.f32 $0, [$1];", "=r,l", [code_ptr + nibble], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        values = tl.load(code_ptr + nibble)
    return values


@triton.jit
def _load_w_tile(
    w_ptr,  # 4-bit: packed bytes (uint8); int8: codes (N, K)
    absmax_ptr,  # 4-bit: fp32 scales or uint8 codes (NESTED); int8: fp32 row scales
    code_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    rows,  # (ROWS,) weight rows of the tile
    col0,  # first weight column of the tile
    n_rows,  # weight shape (N, K)
    n_cols,
    WEIGHT_KIND: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,  # ALIGNED: columns per scale in the tile = min(BLOCKSIZE, COLS)
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DTYPE: tl.constexpr,
    LUT_ASM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """W[rows, col0 : col0 + COLS] dequantized and rounded to ``DTYPE``: a (ROWS, COLS) tile.

    Entries outside W hold finite junk (e.g. ``code[0] * offset``), never NaN: the other operand is zero there.
    """
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    if WEIGHT_KIND == 0:
        # K % BLOCKSIZE == 0 and col0 % SUB == 0, so each sub-block lies in one absmax block, wholly in or out of W.
        sub_start = col0 + tl.arange(0, COLS // SUB) * SUB  # (NB,) first column of each sub-block
        sub_ok = row_ok[:, None] & (sub_start < n_cols)[None, :]  # (ROWS, NB)
        byte_in_row = (sub_start // 2)[:, None] + tl.arange(0, SUB // 2)[None, :]  # (NB, SUB/2)
        byte_ptrs = w_ptr + rows64[:, None, None] * (n_cols // 2) + byte_in_row[None, :, :]
        packed = tl.load(byte_ptrs, mask=sub_ok[:, :, None], other=0)  # (ROWS, NB, SUB/2)
        block_idx = rows64[:, None] * (n_cols // BLOCKSIZE) + (sub_start // BLOCKSIZE)[None, :]
        scale = _load_absmax(
            absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, block_idx, sub_ok, NESTED, NESTED_BLOCKSIZE
        )[:, :, None]
        packed = packed.to(tl.int32)  # element 2j is the high nibble of byte j
        high = _code_values(code_ptr, packed >> 4, LUT_ASM)
        low = _code_values(code_ptr, packed & 0xF, LUT_ASM)
        w = tl.interleave(_round_to(high * scale, DTYPE, INTERPRET), _round_to(low * scale, DTYPE, INTERPRET))
        w = tl.reshape(w, (ROWS, COLS))  # (ROWS, NB, SUB) -> (ROWS, COLS)
    elif WEIGHT_KIND == 1:
        cols = col0 + tl.arange(0, COLS)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        idx = rows64[:, None] * n_cols + cols[None, :]  # element index in the row-major flattened W
        byte = tl.load(w_ptr + idx // 2, mask=mask, other=0).to(tl.int32)
        nibble = (byte >> (4 - (idx % 2) * 4).to(tl.int32)) & 0xF
        scale = _load_absmax(
            absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, idx // BLOCKSIZE, mask, NESTED, NESTED_BLOCKSIZE
        )
        w = _round_to(_code_values(code_ptr, nibble, LUT_ASM) * scale, DTYPE, INTERPRET)
    else:
        cols = col0 + tl.arange(0, COLS)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        cb = tl.load(w_ptr + rows64[:, None] * n_cols + cols[None, :], mask=mask, other=0)
        scb = tl.load(absmax_ptr + rows, mask=row_ok, other=0.0)
        # (cb * scb) * (1/127) in this order, like the reference and bitsandbytes.
        w = _round_to(cb.to(tl.float32) * scb[:, None] * _INV_127, DTYPE, INTERPRET)
    return w


@triton.jit
def _dequant_matmul_kernel(
    a_ptr,  # (M, R): x (forward) or g (backward), any strides
    w_ptr,
    absmax_ptr,
    code_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    bias_ptr,  # (P,) (HAS_BIAS)
    out_ptr,  # (M, P) in a.dtype, row stride stride_om
    M,
    P,
    R,
    n_rows,  # W shape (N, K)
    n_cols,
    stride_am,
    stride_ar,
    stride_om,
    W_TRANSPOSED: tl.constexpr,  # True: b = W.T (y = x @ W.T); False: b = W (dx = g @ W)
    WEIGHT_KIND: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr,  # accumulate out.T = b.T @ a.T, decoded W on the left
    DOT_FP32: tl.constexpr,  # fp32 inputs: exact fp32 dot (also the interpreter, whose bf16 dot is broken)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    LUT_ASM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out (M, P) = a (M, R) @ b (R, P) (+ bias), b = W.T or W dequantized to a.dtype; fp32 accumulation."""
    # Grouped ordering (tutorial 03): GROUP_M consecutive programs share a column strip of W.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(P, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64) * stride_am  # (BLOCK_M,) row starts, int64: M * R may exceed 2**31
    dtype = a_ptr.dtype.element_ty

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        k_ok = (k0 + offs_k) < R  # the reduction tail: a is zero there, so W's junk does not count
        if W_TRANSPOSED:  # b[k, n] = W[n, k]: rows offs_n, columns k0 + offs_k
            w = _load_w_tile(
                w_ptr, absmax_ptr, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                offs_n, k0, n_rows, n_cols,
                WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_N, BLOCK_K, dtype, LUT_ASM, INTERPRET,
            )  # fmt: skip
            if not SWAP_AB:  # (BLOCK_N, BLOCK_K) = b.T tile -> (BLOCK_K, BLOCK_N) = b tile
                w = tl.trans(w)
        else:  # b[k, n] = W[k, n]: rows k0 + offs_k, columns pid_n * BLOCK_N + ...
            w = _load_w_tile(
                w_ptr, absmax_ptr, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                k0 + offs_k, pid_n * BLOCK_N, n_rows, n_cols,
                WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB, BLOCK_K, BLOCK_N, dtype, LUT_ASM, INTERPRET,
            )  # fmt: skip
            if SWAP_AB:  # (BLOCK_K, BLOCK_N) = b tile -> (BLOCK_N, BLOCK_K) = b.T tile
                w = tl.trans(w)
        if SWAP_AB:  # out.T tile += b.T tile @ a.T tile
            a_t = tl.load(  # (BLOCK_K, BLOCK_M) = a.T tile
                a_rows[None, :] + (k0 + offs_k)[:, None] * stride_ar,
                mask=k_ok[:, None] & (offs_m < M)[None, :],
                other=0.0,
            )
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), a_t.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, a_t, acc)
        else:  # out tile += a tile @ b tile
            a = tl.load(  # (BLOCK_M, BLOCK_K)
                a_rows[:, None] + (k0 + offs_k)[None, :] * stride_ar,
                mask=(offs_m < M)[:, None] & k_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)

    # Epilogue: bias (rounded to a.dtype, like the reference's cast) joins the fp32 sum; one rounding to a.dtype.
    mask_n = offs_n < P
    out_rows = out_ptr + offs_m.to(tl.int64) * stride_om
    if SWAP_AB:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += _round_to(bias, dtype, INTERPRET).to(tl.float32)[:, None]
        out_ptrs = out_rows[None, :] + offs_n[:, None]
        tl.store(out_ptrs, _round_to(acc, dtype, INTERPRET), mask=mask_n[:, None] & (offs_m < M)[None, :])
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += _round_to(bias, dtype, INTERPRET).to(tl.float32)[None, :]
        out_ptrs = out_rows[:, None] + offs_n[None, :]
        tl.store(out_ptrs, _round_to(acc, dtype, INTERPRET), mask=(offs_m < M)[:, None] & mask_n[None, :])


def pick_config(
    m: int, p: int, r: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> DequantMatmulConfig:
    """Default tiling of ``out (m, p) = a (m, r) @ b`` for ``a`` of ``dtype``.

    GPU, 16-bit: 128 x 128 output tiles with BLOCK_K 64, 8 warps, 3 stages (tutorial 03's best bf16 tiling on Hopper;
    the decoded 128 x 64 W tile is 32 values per thread, ~170 registers, no spills) and W as the register MMA operand
    (``swap_ab``). Fewer rows than 128 shrink ``block_m`` so no program multiplies mostly padding. fp32 (exact fp32
    products, no tensor cores): 64 x 64 x 32 tiles, 4 warps, the largest that do not spill registers. The interpreter
    is fastest with the fewest, largest programs, so there tiles cover up to 64 x 64 x 128 of the problem.
    """
    if device.type != "cuda":
        return DequantMatmulConfig(
            block_m=min(64, max(16, triton.next_power_of_2(m))),
            block_n=min(64, max(16, triton.next_power_of_2(p))),
            block_k=min(128, max(16, triton.next_power_of_2(r))),
            num_warps=4,
            num_stages=1,
        )
    if dtype == torch.float32:
        return DequantMatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    return DequantMatmulConfig(block_m=min(128, max(16, triton.next_power_of_2(m))))


def _weight_args(weight: QuantizedWeight) -> tuple[tuple, tuple]:
    """(pointer args, (WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE)) of a checked weight, memoized on it."""
    if isinstance(weight, Int8Rowwise):
        key = ("dequant_matmul", weight.cb.data_ptr(), weight.scb.data_ptr())
    elif isinstance(weight, Packed4bit):
        key = ("dequant_matmul", weight.data.data_ptr(), weight.absmax.data_ptr())
    else:
        raise TypeError(
            f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}; build one with "
            "`peft_fastlora.bnb_weights.packed4bit_from_bnb` or `int8_from_bnb`."
        )
    return _cached(weight, key, lambda: _build_weight_args(weight))


def _build_weight_args(weight: QuantizedWeight) -> tuple[tuple, tuple]:
    if isinstance(weight, Int8Rowwise):
        check_int8(weight)
        scb = weight.scb
        return (weight.cb, scb, scb, scb, scb, scb), (_KIND_INT8, 1, False, 1)
    data = check_packed4bit(weight)
    bs = weight.blocksize
    aligned = weight.shape[1] % bs == 0 and bs >= _MIN_ALIGNED_BLOCKSIZE
    nested_code, nested_absmax, offset, nested_bs = _nested_args(weight)
    meta = (_KIND_4BIT_ALIGNED if aligned else _KIND_4BIT_ANY, bs, weight.nested, nested_bs)
    return (data, weight.absmax, weight.code, nested_code, nested_absmax, offset), meta


def _check_activation(a: torch.Tensor, name: str, weight: QuantizedWeight, size: int, what: str) -> None:
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(a).__name__}.")
    if a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"`{name}` must have dtype in {SUPPORTED_DTYPES}, got {a.dtype!r}; cast it first.")
    if a.dim() < 1 or a.shape[-1] != size:
        raise ValueError(
            f"`{name}` must have shape (..., {size}) ({what} of the weight {tuple(weight.shape)}), "
            f"got {tuple(a.shape)}."
        )
    if a.device != weight.device:
        raise ValueError(f"`{name}` is on {a.device} but the weight is on {weight.device}; move it to {weight.device}.")


def _run(
    a: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    w_transposed: bool,
    config: Optional[DequantMatmulConfig],
) -> torch.Tensor:
    """Flattens ``a`` to (M, R), allocates ``out`` (M, P) in a.dtype and launches; returns ``out`` as (..., P)."""
    w_args, w_meta = _weight_args(weight)
    n, k = weight.shape
    r, p = (k, n) if w_transposed else (n, k)
    a2d = a.reshape(-1, r)
    m = a2d.shape[0]
    out = torch.empty((m, p), dtype=a.dtype, device=a.device)
    if m == 0 or p == 0:
        return out.view(*a.shape[:-1], p)
    if r == 0:
        out.zero_()
        return out.view(*a.shape[:-1], p) if bias is None else (out + bias.to(a.dtype)).view(*a.shape[:-1], p)
    _require_launchable(a.device)
    if config is None:
        config = pick_config(m, p, r, a.device, a.dtype)
    interpret = _is_interpreted(_dequant_matmul_kernel)
    kind, blocksize = w_meta[0], w_meta[1]
    cols = config.block_k if w_transposed else config.block_n  # tile width along W's columns
    sub = min(blocksize, cols) if kind == _KIND_4BIT_ALIGNED else cols
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(p, config.block_n),)
    args = (
        a2d,
        *w_args,
        bias if bias is not None else out,
        out,
        m,
        p,
        r,
        n,
        k,
        a2d.stride(0),
        a2d.stride(1),
        out.stride(0),
        w_transposed,
        *w_meta,  # WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE
        sub,
        bias is not None,
        config.swap_ab,
        interpret or a.dtype == torch.float32,  # DOT_FP32
        config.block_m,
        config.block_n,
        config.block_k,
        config.group_m,
        config.lut_asm and not interpret,  # the interpreter cannot run PTX
        interpret,
    )
    # Per-element gathers (odd layouts) staged by the pipeliner would need > 228 KB of shared memory: no pipelining.
    num_stages = 1 if kind == _KIND_4BIT_ANY else config.num_stages
    # enable_fp_fusion=False: the nested scale is a multiply then an add, never an FMA (bit-exact with dequant.py).
    options = dict(num_warps=config.num_warps, num_stages=num_stages, enable_fp_fusion=False)
    launch(_dequant_matmul_kernel, grid, args, a.device, **options)
    return out.view(*a.shape[:-1], p)


def dequant_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor] = None,
    config: Optional[DequantMatmulConfig] = None,
) -> torch.Tensor:
    """``x @ dequant(W).T (+ bias)`` in one kernel that dequantizes W tile by tile, never materializing it.

    Numerics: W is dequantized exactly as [`dequantize`] does and rounded to ``x.dtype``; products are summed in fp32
    (fp32 ``x``: exact fp32 products, no TF32) and rounded once, with the bias (cast to ``x.dtype``) in the sum.

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32, on the weight's device.
        weight ([`Packed4bit`] or [`Int8Rowwise`]): The quantized weight ``(out_features, in_features)``.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``, cast to ``x.dtype``.
        config ([`DequantMatmulConfig`], *optional*): Tiling; [`pick_config`] when None (benchmarks sweep it).

    Returns:
        `torch.Tensor`: ``(..., out_features)`` in ``x.dtype``.
    """
    _weight_args(weight)  # type check and validation first: the errors below name its shape
    n, k = weight.shape
    _check_activation(x, "x", weight, k, "in_features")
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"`bias` must have shape ({n},), got {tuple(bias.shape)}.")
        if bias.device != weight.device:
            raise ValueError(f"`bias` is on {bias.device} but the weight is on {weight.device}; move it.")
        bias = bias.contiguous()
    return _run(x, weight, bias, True, config)


def dequant_matmul_t(
    grad_out: torch.Tensor, weight: QuantizedWeight, config: Optional[DequantMatmulConfig] = None
) -> torch.Tensor:
    """``grad_out @ dequant(W)``: the input gradient of a quantized linear layer, W dequantized tile by tile.

    Numerics as [`dequant_matmul`]: W rounded to ``grad_out.dtype``, fp32 sums, one rounding.

    Args:
        grad_out (`torch.Tensor`): ``(..., out_features)`` in fp16, bf16 or fp32, on the weight's device.
        weight ([`Packed4bit`] or [`Int8Rowwise`]): The quantized weight ``(out_features, in_features)``.
        config ([`DequantMatmulConfig`], *optional*): Tiling; [`pick_config`] when None.

    Returns:
        `torch.Tensor`: ``(..., in_features)`` in ``grad_out.dtype``.
    """
    _weight_args(weight)
    _check_activation(grad_out, "grad_out", weight, weight.shape[0], "out_features")
    return _run(grad_out, weight, None, False, config)
