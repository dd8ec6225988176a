"""Triton dequantization of bitsandbytes weights (4-bit NF4/FP4 and row-scaled int8), bit-exact with the reference.

One launch per weight. The 4-bit kernel reads each packed byte once and writes its two values (high nibble first,
interleaved so each thread's values are contiguous: one wide store), decoding the per-block scale - including a
double-quantized one - in the same program. Math is fp32 with one final rounding, exactly like
``reference.dequantize_4bit_ref`` and bitsandbytes' CUDA kernel:

    W[i] = code[nibble(i)] * absmax[i // blocksize]
    absmax[j] = nested_code[absmax_u8[j]] * nested_absmax[j // nested_blocksize] + offset   (double quantization)

The kernels are compiled with ``enable_fp_fusion=False`` so the multiply-then-add of the nested scale is never
contracted into an FMA (that would change the last bit).

The launchers take arguments that ``peft_fastlora.ops.dispatch`` has checked; their launch arguments are memoized
on the weight container (``quant_state.memo``) per output dtype and, for [`dequantize_window`], per window (a few per
weight: ``lora_linear.weight_windows`` makes at most four of each dimension).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..quant_state import Int8Rowwise, Packed4bit, QuantizedWeight, memo
from .jit import INV_127, decode_nibbles, load_absmax, round_to
from .launch import cdiv, is_interpreted, launch, next_power_of_2, require_launchable

# 4-bit tiling (a sweep of tilings on an H200, bf16 out): 16 packed bytes per thread x 4 warps
# reach 70% (4096x4096) and 87% (14336x4096) of a device-to-device copy. fp32 outputs take half the bytes per thread
# (same registers).
NUM_WARPS_4BIT = 4
BYTES_PER_THREAD = 16  # for 2-byte outputs
INTERPRETER_BLOCK_BYTES = 8192  # the interpreter is fastest with few, large programs
# int8: elements per program, and warps.
INT8_BLOCK = 4096
NUM_WARPS_INT8 = 8


@triton.jit
def _dequant_4bit_kernel(
    data_ptr,  # uint8 (n_bytes,): two codes per byte, high nibble = even element
    absmax_ptr,  # fp32 (n_blocks,), or uint8 codes when NESTED
    code_ptr,  # fp32 (16,)
    nested_code_ptr,  # fp32 (256,)            (NESTED only)
    nested_absmax_ptr,  # fp32 (n_blocks / NESTED_BLOCKSIZE,)  (NESTED only)
    offset_ptr,  # fp32 ()                   (NESTED only)
    out_ptr,  # (n_elements,) in the output dtype, or rows of 2 * window_bytes elements every out_stride (STRIDED_OUT)
    out_stride,  # STRIDED_OUT: elements from one output row to the next
    n_elements,  # of the output
    n_bytes,  # packed bytes the output is made of
    window_bytes,  # WINDOWED: packed bytes per row of the output (its columns / 2)
    row_bytes,  # WINDOWED: packed bytes per row of the weight
    start_byte,  # WINDOWED: the window's first packed byte in the weight
    HALF_BLOCK: tl.constexpr,  # bytes per absmax block = blocksize // 2
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    ROWS: tl.constexpr,  # the program's bytes seen as a (ROWS, COLS) tile where each row lies inside one
    COLS: tl.constexpr,  # absmax block, so one scale is loaded per row instead of per byte
    WINDOWED: tl.constexpr,  # the output is a window of rows x whole absmax blocks of the weight, not all of it
    INTERPRET: tl.constexpr,
    STRIDED_OUT: tl.constexpr,  # output rows are out_stride apart (rows of whole absmax blocks only)
):
    pid = tl.program_id(0).to(tl.int64)
    first_byte = pid * (ROWS * COLS)
    row_start = first_byte + tl.arange(0, ROWS) * COLS  # (ROWS,) in the output's packed bytes
    if WINDOWED:  # a tile row lies inside one absmax block of the window, so it is one run of weight bytes too
        src_start = (row_start // window_bytes) * row_bytes + start_byte + row_start % window_bytes
    else:
        src_start = row_start
    inside = row_start < n_bytes  # whole tile rows: n_bytes is a multiple of COLS whenever WINDOWED
    offs_b = src_start[:, None] + tl.arange(0, COLS)[None, :]  # (ROWS, COLS)
    in_bytes = (row_start[:, None] + tl.arange(0, COLS)[None, :]) < n_bytes
    packed = tl.load(data_ptr + offs_b, mask=in_bytes, other=0)
    scale = load_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, src_start // HALF_BLOCK,
                        inside, NESTED, NESTED_BLOCKSIZE)[:, None]  # fmt: skip
    out_ty = out_ptr.dtype.element_ty
    high, low = decode_nibbles(packed, code_ptr)
    values = tl.interleave(round_to(high * scale, out_ty, INTERPRET), round_to(low * scale, out_ty, INTERPRET))
    elems = 2 * row_start[:, None] + tl.arange(0, 2 * COLS)[None, :]  # in the output's row-major numbering
    if STRIDED_OUT:  # a tile row lies inside one output row (whole absmax blocks), so it is one run there too
        row_len = 2 * window_bytes
        first = 2 * row_start
        offs_o = ((first // row_len) * out_stride + first % row_len)[:, None] + tl.arange(0, 2 * COLS)[None, :]
    else:
        offs_o = elems
    tl.store(out_ptr + offs_o, values, mask=elems < n_elements)


@triton.jit
def _dequant_int8_kernel(
    cb_ptr,  # int8 (N, K), row-major
    scb_ptr,  # fp32 (N,)
    out_ptr,  # (rows_out, cols_out): the window of the weight starting at (row0, col0)
    out_stride,  # elements from one output row to the next (cols_out when contiguous)
    rows_out,
    K,
    cols_out,
    row0,
    col0,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < rows_out)[:, None] & (offs_k < cols_out)[None, :]
    cb = tl.load(cb_ptr + (row0 + offs_n)[:, None] * K + col0 + offs_k[None, :], mask=mask, other=0).to(tl.float32)
    scb = tl.load(scb_ptr + row0 + offs_n, mask=offs_n < rows_out, other=0.0)
    # (cb * scb) * (1/127) in this order, like the reference and bitsandbytes.
    values = cb * scb[:, None] * INV_127
    offs = offs_n[:, None] * out_stride + offs_k[None, :]
    tl.store(out_ptr + offs, round_to(values, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def packed_bytes(weight: Packed4bit) -> torch.Tensor:
    """The packed codes as a flat uint8 view (no copy); ``weight.data`` is contiguous (checked at the door)."""
    return weight.data.reshape(-1).view(torch.uint8)


def nested_args(weight: Packed4bit) -> tuple:
    """(nested_code, nested_absmax, offset, nested_blocksize); unused dummies (``absmax``) when not nested."""
    if weight.nested:
        return weight.nested_code, weight.nested_absmax, weight.offset, weight.nested_blocksize
    return weight.absmax, weight.absmax, weight.absmax, 1


class DequantArgs(NamedTuple):
    """One dequant launch, all but its output: kernel arguments before ``out_ptr`` and after its row stride, grid
    and options; ``strided_flag``: the 4-bit kernel takes a last constexpr saying whether rows are strided."""

    kernel: object
    device: torch.device
    grid: tuple
    before_out: tuple
    after_out: tuple
    options: dict
    strided_flag: bool = False


# A window of the weight: ((first row, end row), (first column, end column)); None is the whole weight.
Window = Optional[tuple[tuple[int, int], tuple[int, int]]]


def _args_4bit(weight: Packed4bit, dtype: torch.dtype, block_bytes: Optional[int], num_warps: int,
               window: Window = None) -> DequantArgs:  # fmt: skip
    data = packed_bytes(weight)
    require_launchable(_dequant_4bit_kernel, data.device)
    interpret = is_interpreted(_dequant_4bit_kernel)
    if block_bytes is None:
        bytes_per_thread = BYTES_PER_THREAD * 2 // torch.empty((), dtype=dtype).element_size()
        block_bytes = INTERPRETER_BLOCK_BYTES if interpret else bytes_per_thread * 32 * num_warps
    n_rows, n_cols = weight.shape
    (row0, row1), (col0, col1) = window if window is not None else ((0, n_rows), (0, n_cols))
    n = weight.numel if window is None else (row1 - row0) * (col1 - col0)
    n_bytes = (n + 1) // 2
    half_block = weight.blocksize // 2
    cols = min(half_block, block_bytes)  # powers of two, so cols divides block_bytes and half_block
    nested_code, nested_absmax, offset, nested_blocksize = nested_args(weight)
    before = (data, weight.absmax, weight.code, nested_code, nested_absmax, offset)
    bytes_ = ((col1 - col0) // 2, n_cols // 2, (row0 * n_cols + col0) // 2)  # window, row, start (in packed bytes)
    after = (n, n_bytes, *bytes_, half_block, weight.nested, nested_blocksize, block_bytes // cols, cols,
             window is not None, interpret)  # fmt: skip
    options = dict(num_warps=num_warps, enable_fp_fusion=False)
    grid = (cdiv(n_bytes, block_bytes),)
    return DequantArgs(_dequant_4bit_kernel, data.device, grid, before, after, options, strided_flag=True)


def _args_int8(weight: Int8Rowwise, dtype: torch.dtype, window: Window = None) -> DequantArgs:
    require_launchable(_dequant_int8_kernel, weight.device)
    n_rows, n_cols = weight.shape
    (row0, row1), (col0, col1) = window if window is not None else ((0, n_rows), (0, n_cols))
    block_k = min(next_power_of_2(max(col1 - col0, 1)), INT8_BLOCK)
    block_n = INT8_BLOCK // block_k
    grid = (cdiv(row1 - row0, block_n), cdiv(col1 - col0, block_k))
    after = (row1 - row0, n_cols, col1 - col0, row0, col0, block_n, block_k, is_interpreted(_dequant_int8_kernel))
    options = dict(num_warps=NUM_WARPS_INT8, enable_fp_fusion=False)
    return DequantArgs(_dequant_int8_kernel, weight.device, grid, (weight.cb, weight.scb), after, options)


def check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device, strided_ok: bool) -> bool:
    """Checks a caller's ``out`` for a ``shape`` output; returns whether its rows are strided (a row-major view
    whose rows are further apart than their length, e.g. the first columns of a wider matrix)."""
    if out.shape != torch.Size(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"`out` must be a {tuple(shape)} {dtype} tensor on {device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}.")  # fmt: skip
    rows, cols = shape
    if out.is_contiguous():
        return False
    if out.stride(1) != 1 or out.stride(0) < cols:
        raise ValueError(f"`out` must be row-major (unit column stride, row stride >= {cols}), got strides "
                         f"{out.stride()}; pass a contiguous tensor or the first columns of one.")  # fmt: skip
    if not strided_ok:
        raise ValueError("`out` with strided rows needs a weight whose rows are whole absmax blocks "
                         "(in_features % blocksize == 0); pass a contiguous `out`.")  # fmt: skip
    return True


def _run(args: DequantArgs, shape: tuple, dtype: torch.dtype, out: Optional[torch.Tensor],
         strided_ok: bool = True) -> torch.Tensor:  # fmt: skip
    """Allocates the output (unless given) and launches into it; an empty weight launches nothing."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=args.device)
        strided = False
    else:
        strided = check_out(out, shape, dtype, args.device, strided_ok)
    if out.numel():
        flag = (strided,) if args.strided_flag else ()
        launch(args.kernel, args.grid, args.before_out + (out, out.stride(0)) + args.after_out + flag, args.device,
               **args.options)  # fmt: skip
    return out


def dequantize_4bit(
    weight: Packed4bit,
    dtype: torch.dtype,
    out: Optional[torch.Tensor] = None,
    *,
    block_bytes: Optional[int] = None,
    num_warps: int = NUM_WARPS_4BIT,
) -> torch.Tensor:
    """Dequantizes a checked 4-bit NF4/FP4 weight in one Triton launch, bit-exact with [`dequantize_4bit_ref`].

    Args:
        weight ([`Packed4bit`]): The packed weight (any storage dtype, any blocksize, optionally double-quantized).
        dtype (`torch.dtype`): Output dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        out (`torch.Tensor`, *optional*): A ``weight.shape`` tensor of ``dtype`` on the weight's device: contiguous,
            or (rows of whole absmax blocks only) row-major with rows further apart, e.g. ``wide[:, :in_features]``.
        block_bytes, num_warps: An explicit tiling (tests and benchmarks); by default the memoized one.

    Returns:
        `torch.Tensor`: The ``(out_features, in_features)`` weight in ``dtype`` (``out`` when given).
    """
    if block_bytes is None and num_warps == NUM_WARPS_4BIT:
        args = memo(weight, ("dequant", dtype), lambda: _args_4bit(weight, dtype, None, num_warps))
    else:
        args = _args_4bit(weight, dtype, block_bytes, num_warps)
    return _run(args, weight.shape, dtype, out, strided_ok=column_alignment(weight) > 0)


def dequantize_int8(weight: Int8Rowwise, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes a checked row-scaled int8 weight (``cb * scb[:, None] / 127``), bit-exact with the reference;
    ``out`` as for [`dequantize_4bit`] (any int8 weight may write strided rows)."""
    args = memo(weight, ("dequant", dtype), lambda: _args_int8(weight, dtype))
    return _run(args, weight.shape, dtype, out)


def column_alignment(weight: QuantizedWeight) -> int:
    """Windows of the weight ([`dequantize_window`]) start and end on columns that are multiples of this: a 4-bit
    weight's blocksize (a window is whole absmax blocks of each row), 1 for int8; 0 when the weight takes no windows
    (4-bit rows that are not whole blocks). Rows may be cut anywhere."""
    if isinstance(weight, Int8Rowwise):
        return 1
    return weight.blocksize if weight.shape[1] % weight.blocksize == 0 else 0


def dequantize_window(
    weight: QuantizedWeight,
    dtype: torch.dtype,
    rows: tuple[int, int],
    columns: tuple[int, int],
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rows ``[rows[0], rows[1])`` x columns ``[columns[0], columns[1])`` of the dequantized weight, bit-exact with
    ``dequantize_ref(weight, dtype)[r0:r1, c0:c1]``; the rest of the weight is never made.

    Args:
        weight: A checked 4-bit or int8 weight (4-bit: rows of whole absmax blocks, see [`column_alignment`]).
        dtype (`torch.dtype`): Output dtype.
        rows (`tuple[int, int]`): ``0 <= r0 < r1 <= out_features``.
        columns (`tuple[int, int]`): ``0 <= c0 < c1 <= in_features``, multiples of ``column_alignment(weight)``.
        out (`torch.Tensor`, *optional*): Where to write the window: contiguous, or row-major with rows further
            apart (a view of the first columns of a wider matrix, which the fused MLP fills with its LoRA factors).
            By default a new contiguous tensor.
    """
    (row0, row1), (col0, col1) = rows, columns
    n_rows, n_cols = weight.shape
    align = column_alignment(weight)
    if not align or not (0 <= row0 < row1 <= n_rows and 0 <= col0 < col1 <= n_cols) or col0 % align or col1 % align:
        raise ValueError(
            f"`rows`, `columns` = {rows}, {columns}: a window of a {tuple(weight.shape)} weight needs "
            f"0 <= r0 < r1 <= {n_rows} and 0 <= c0 < c1 <= {n_cols}, columns multiples of "
            f"{align or 'its blocksize'} (a 4-bit weight's rows must be whole absmax blocks); dequantize the whole "
            "weight instead."
        )
    window = ((row0, row1), (col0, col1))
    if window == ((0, n_rows), (0, n_cols)):
        return dequantize_triton(weight, dtype, out)
    if isinstance(weight, Int8Rowwise):
        build = functools.partial(_args_int8, weight, dtype, window)
    else:
        build = functools.partial(_args_4bit, weight, dtype, None, NUM_WARPS_4BIT, window)
    return _run(memo(weight, ("dequant", dtype, window), build), (row1 - row0, col1 - col0), dtype, out)


def dequantize_triton(weight: QuantizedWeight, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes either kind of checked weight to ``dtype`` (see [`dequantize_4bit`], [`dequantize_int8`])."""
    if isinstance(weight, Int8Rowwise):
        return dequantize_int8(weight, dtype, out)
    return dequantize_4bit(weight, dtype, out)
