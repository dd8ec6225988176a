"""Triton dequantization of bitsandbytes weights (4-bit NF4/FP4 and row-scaled int8), bit-exact with the reference.

One launch per weight. The 4-bit kernel reads each packed byte once and writes its two values (high nibble first),
decoding the per-block scale - including a double-quantized one - in the same program. Math is fp32 with one final
rounding, exactly like ``reference.dequantize_4bit_ref`` and bitsandbytes' CUDA kernel:

    W[i] = code[nibble(i)] * absmax[i // blocksize]
    absmax[j] = nested_code[absmax_u8[j]] * nested_absmax[j // nested_blocksize] + offset   (double quantization)

The kernels are compiled with ``enable_fp_fusion=False`` so the multiply-then-add of the nested scale is never
contracted into an FMA (that would change the last bit). The ``@triton.jit`` helpers (``_decode_nibbles``,
``_decode_absmax``, ``_round_to``) are shared with the fused small-M kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import _is_interpreted, cdiv, launch, next_power_of_2
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight
from .reference import INT8_INV_127

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# 4-bit tiling, from the sweep of ``benchmarks/gpu_kernel_smoke.py --sweep`` (H200, Triton 3.6, bf16 out, layout 0):
# 16 packed bytes per thread x 4 warps reached 70% (4096x4096) and 87% (14336x4096) of a d2d copy, against 57% and 63%
# for the former 4 bytes x 8 warps; layouts 1 (pairs) and 2 (per element) were 2-40x slower. fp32 outputs take half
# the bytes per thread (same registers; not swept).
_NUM_WARPS = 8  # int8 kernel
_NUM_WARPS_4BIT = 4
_BYTES_PER_THREAD = 16  # for 2-byte outputs; 8 for fp32
_LAYOUT = 0
# int8: elements per program.
_INT8_BLOCK = 4096
# Kernels may only read globals that are constexpr.
_INV_127 = tl.constexpr(INT8_INV_127)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> ``dtype`` with round-to-nearest-even, like ``torch.Tensor.to``.

    Compiled Triton already rounds to nearest even; the 3.x interpreter truncates fp32 -> bf16, so there the
    rounding is done on the bits (finite inputs only, which is all a dequantized weight holds).
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _mul_rn(a, b):
    """``a * b`` in fp32, rounded once: PTX ``mul.rn`` is never fused with a following add (CUDA only)."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _decode_nibbles(packed, code_ptr):
    """uint8 codes -> (value of the high nibble, value of the low nibble) as fp32 ``code`` entries."""
    packed = packed.to(tl.int32)
    high = tl.load(code_ptr + (packed >> 4))
    low = tl.load(code_ptr + (packed & 0xF))
    return high, low


@triton.jit
def _decode_absmax(
    raw,  # absmax[block_idx] as stored: fp32 scales, or uint8 codes when NESTED
    block_idx,
    mask,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    MUL_RN: tl.constexpr = False,
):
    """fp32 scales from the stored absmax values (split from the load so the fused kernel can prefetch ``raw``).

    Two roundings (multiply, then add) like bitsandbytes. Kernels launched with ``enable_fp_fusion=False`` get that
    from the compiler; ``MUL_RN`` (compiled kernels only, not the interpreter) makes the multiply a PTX ``mul.rn``,
    which is never contracted into an FMA, so the caller may keep fp fusion on for the rest of its math.
    """
    if NESTED:
        nested_scale = tl.load(nested_absmax_ptr + block_idx // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        nested_value = tl.load(nested_code_ptr + raw.to(tl.int32))
        if MUL_RN:
            scale = _mul_rn(nested_value, nested_scale)
        else:
            scale = nested_value * nested_scale
        scale = scale + tl.load(offset_ptr)
    else:
        scale = raw
    return scale


@triton.jit
def _load_absmax(
    absmax_ptr,
    nested_code_ptr,
    nested_absmax_ptr,
    offset_ptr,
    block_idx,
    mask,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
):
    """fp32 scales of the blocks ``block_idx`` (any shape), decoding double quantization when ``NESTED``."""
    raw = tl.load(absmax_ptr + block_idx, mask=mask, other=0)
    return _decode_absmax(
        raw, block_idx, mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE
    )


@triton.jit
def _dequant_4bit_kernel(
    data_ptr,  # uint8 (n_bytes,): two codes per byte, high nibble = even element
    absmax_ptr,  # fp32 (n_blocks,), or uint8 codes when NESTED
    code_ptr,  # fp32 (16,)
    nested_code_ptr,  # fp32 (256,)            (NESTED only)
    nested_absmax_ptr,  # fp32 (n_blocks / NESTED_BLOCKSIZE,)  (NESTED only)
    offset_ptr,  # fp32 ()                   (NESTED only)
    out_ptr,  # (n_elements,) in the output dtype
    n_elements,
    n_bytes,
    HALF_BLOCK: tl.constexpr,  # bytes per absmax block = blocksize // 2
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    ROWS: tl.constexpr,  # the program's bytes seen as a (ROWS, COLS) tile where each row lies inside one
    COLS: tl.constexpr,  # absmax block, so one scale is loaded per row instead of per byte
    LAYOUT: tl.constexpr,  # how the two values of a byte reach memory: 0 interleave, 1 pairs, 2 per element
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    first_byte = pid * (ROWS * COLS)
    row_start = first_byte + tl.arange(0, ROWS) * COLS  # (ROWS,)
    offs_b = row_start[:, None] + tl.arange(0, COLS)[None, :]  # (ROWS, COLS)
    if LAYOUT != 2:
        packed = tl.load(data_ptr + offs_b, mask=offs_b < n_bytes, other=0)

    scale = _load_absmax(
        absmax_ptr,
        nested_code_ptr,
        nested_absmax_ptr,
        offset_ptr,
        row_start // HALF_BLOCK,
        row_start < n_bytes,
        NESTED,
        NESTED_BLOCKSIZE,
    )[:, None]
    out_ty = out_ptr.dtype.element_ty
    if LAYOUT == 0:  # interleave: each thread's values of its bytes are contiguous -> one wide store
        high, low = _decode_nibbles(packed, code_ptr)
        values = tl.interleave(_round_to(high * scale, out_ty, INTERPRET), _round_to(low * scale, out_ty, INTERPRET))
        offs_o = 2 * row_start[:, None] + tl.arange(0, 2 * COLS)[None, :]
        tl.store(out_ptr + offs_o, values, mask=offs_o < n_elements)
    elif LAYOUT == 1:  # pairs: (ROWS, COLS, 2) stored as is, no reshape (so no register shuffle), 2-wide stores
        high, low = _decode_nibbles(packed, code_ptr)
        values = tl.join(_round_to(high * scale, out_ty, INTERPRET), _round_to(low * scale, out_ty, INTERPRET))
        offs_o = 2 * offs_b[:, :, None] + tl.arange(0, 2)[None, None, :]
        tl.store(out_ptr + offs_o, values, mask=offs_o < n_elements)
    else:  # per element: every value re-reads its byte (L1 hit), no join at all; contiguous stores
        cols_o = tl.arange(0, 2 * COLS)[None, :]  # (1, 2 * COLS)
        offs_o = 2 * row_start[:, None] + cols_o
        byte = tl.load(data_ptr + row_start[:, None] + cols_o // 2, mask=offs_o < n_elements, other=0).to(tl.int32)
        nibble = (byte >> (4 - (cols_o % 2) * 4)) & 0xF  # even element: high nibble
        values = _round_to(tl.load(code_ptr + nibble) * scale, out_ty, INTERPRET)
        tl.store(out_ptr + offs_o, values, mask=offs_o < n_elements)


@triton.jit
def _dequant_int8_kernel(
    cb_ptr,  # int8 (N, K), row-major
    scb_ptr,  # fp32 (N,)
    out_ptr,  # (N, K)
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    offs = offs_n[:, None] * K + offs_k[None, :]
    cb = tl.load(cb_ptr + offs, mask=mask, other=0).to(tl.float32)
    scb = tl.load(scb_ptr + offs_n, mask=offs_n < N, other=0.0)
    # (cb * scb) * (1/127) in this order, like the reference and bitsandbytes.
    values = cb * scb[:, None] * _INV_127
    tl.store(out_ptr + offs, _round_to(values, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _require_launchable(device: torch.device) -> None:
    """CPU tensors need the Triton interpreter; say so instead of failing inside Triton."""
    if device.type != "cuda" and not _is_interpreted(_dequant_4bit_kernel):
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got tensors on {device}. Set `TRITON_INTERPRET=1` before importing "
            "triton to run them on CPU, or use `peft_fastlora.ops.reference` instead."
        )


def _check_dtype(dtype: torch.dtype, name: str = "dtype") -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"`{name}` must be one of {SUPPORTED_DTYPES}, got {dtype!r}. Pick a floating output dtype.")


def _check_tensor(t: Optional[torch.Tensor], name: str, device: torch.device, dtype=None, numel=None) -> None:
    """Checks a weight field: present, on ``device``, contiguous, of ``dtype`` and with at least ``numel`` items."""
    if t is None:
        raise ValueError(f"`{name}` is None; rebuild the weight with `packed4bit_from_bnb`.")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device} but the weight data is on {device}; move the whole weight.")
    if not t.is_contiguous():
        raise ValueError(f"`{name}` must be contiguous, got strides {t.stride()}; call `.contiguous()` on it.")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"`{name}` must have dtype {dtype}, got {t.dtype}.")
    if numel is not None and t.numel() < numel:
        raise ValueError(f"`{name}` has {t.numel()} elements but the weight needs at least {numel}.")


def _check_out(out: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"`out` must be a {tuple(shape)} {dtype} tensor on {device}, got {tuple(out.shape)} {out.dtype} on "
            f"{out.device}. Allocate it with `torch.empty(weight.shape, dtype=dtype, device=weight.device)`."
        )
    if not out.is_contiguous():
        raise ValueError(f"`out` must be contiguous, got strides {out.stride()}.")


def check_packed4bit(weight: Packed4bit) -> torch.Tensor:
    """Validates a [`Packed4bit`] and returns its data as a flat uint8 view (no copy)."""
    device = weight.data.device
    bs = weight.blocksize
    if bs < 2 or bs & (bs - 1):
        raise ValueError(f"`weight.blocksize` must be a power of two >= 2 (bitsandbytes uses 64..4096), got {bs}.")
    n = weight.numel
    if n <= 0:
        raise ValueError(f"`weight.shape` must be positive, got {weight.shape}.")
    if not weight.data.is_contiguous():
        raise ValueError(
            f"`weight.data` must be contiguous to be read as packed bytes, got strides {weight.data.stride()}; "
            "call `.contiguous()` on it."
        )
    data = weight.data.reshape(-1).view(torch.uint8)
    _check_tensor(data, "weight.data", device, numel=(n + 1) // 2)
    n_blocks = (n + bs - 1) // bs
    _check_tensor(weight.code, "weight.code", device, torch.float32, 16)
    if weight.nested:
        _check_tensor(weight.absmax, "weight.absmax", device, torch.uint8, n_blocks)
        nbs = weight.nested_blocksize
        if nbs < 1:
            raise ValueError(f"`weight.nested_blocksize` must be >= 1 for a double-quantized weight, got {nbs}.")
        _check_tensor(weight.nested_code, "weight.nested_code", device, torch.float32, 256)
        _check_tensor(weight.nested_absmax, "weight.nested_absmax", device, torch.float32, (n_blocks + nbs - 1) // nbs)
        _check_tensor(weight.offset, "weight.offset", device, torch.float32, 1)
    else:
        _check_tensor(weight.absmax, "weight.absmax", device, torch.float32, n_blocks)
    return data


def check_int8(weight: Int8Rowwise) -> None:
    """Validates an [`Int8Rowwise`]."""
    if weight.cb.dim() != 2:
        raise ValueError(f"`weight.cb` must be 2-D (out_features, in_features), got shape {tuple(weight.cb.shape)}.")
    _check_tensor(weight.cb, "weight.cb", weight.cb.device, torch.int8)
    _check_tensor(weight.scb, "weight.scb", weight.cb.device, torch.float32)
    if weight.scb.numel() != weight.cb.shape[0]:
        raise ValueError(
            f"`weight.scb` must have one scale per row ({weight.cb.shape[0]}), got {weight.scb.numel()} elements."
        )


def _nested_args(weight: Packed4bit) -> tuple:
    """(nested_code, nested_absmax, offset, nested_blocksize); unused dummies (``absmax``) when not nested."""
    if weight.nested:
        return weight.nested_code, weight.nested_absmax, weight.offset, weight.nested_blocksize
    return weight.absmax, weight.absmax, weight.absmax, 1


def _cached(weight: QuantizedWeight, key: tuple, build):
    """``build()``, memoized on the (frozen) weight container under ``key``.

    Validation and launch arguments depend only on the container's fields, so they are computed once per container and
    output dtype; ``key`` also holds the data pointers, so a storage swapped in place (``t.data = ...``) is re-checked.
    """
    cache = weight.__dict__.get("_fastlora_launch_cache")
    if cache is None:
        cache = {}
        object.__setattr__(weight, "_fastlora_launch_cache", cache)  # frozen dataclass: no field, just memo
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = build()
    return plan


def _plan_4bit(
    weight: Packed4bit, dtype: torch.dtype, block_bytes=None, num_warps=_NUM_WARPS_4BIT, layout=None
) -> tuple:
    """(device, grid, args before ``out``, args after ``out``, launch options) of a checked 4-bit weight."""
    _check_dtype(dtype)
    data = check_packed4bit(weight)
    _require_launchable(data.device)
    layout = _LAYOUT if layout is None else layout
    if block_bytes is None:
        if _is_interpreted(_dequant_4bit_kernel):  # the interpreter is fastest with few, large programs
            block_bytes = 8192
        else:
            bytes_per_thread = _BYTES_PER_THREAD * 2 // torch.empty((), dtype=dtype).element_size()
            block_bytes = bytes_per_thread * 32 * num_warps
    n = weight.numel
    n_bytes = (n + 1) // 2
    half_block = weight.blocksize // 2
    cols = min(half_block, block_bytes)  # powers of two, so cols divides block_bytes and half_block
    nested_code, nested_absmax, offset, nested_blocksize = _nested_args(weight)
    grid = (cdiv(n_bytes, block_bytes),)
    before = (data, weight.absmax, weight.code, nested_code, nested_absmax, offset)
    after = (n, n_bytes, half_block, weight.nested, nested_blocksize, block_bytes // cols, cols, layout)
    after += (_is_interpreted(_dequant_4bit_kernel),)
    return data.device, grid, before, after, dict(num_warps=num_warps, enable_fp_fusion=False)


def _launch_dequant_4bit(
    weight: Packed4bit,
    data: torch.Tensor,
    out: torch.Tensor,
    block_bytes: Optional[int] = None,
    num_warps: int = _NUM_WARPS_4BIT,
    layout: Optional[int] = None,
) -> None:
    """Launches the 4-bit kernel with an explicit tiling (benchmarks and tests; ``data`` is unused, kept for them)."""
    device, grid, before, after, options = _plan_4bit(weight, out.dtype, block_bytes, num_warps, layout)
    launch(_dequant_4bit_kernel, grid, before + (out,) + after, device, **options)


def _run_plan(kernel, plan: tuple, shape: tuple, dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Allocates (or checks) the output and launches a memoized dequant plan into it; an empty weight launches
    nothing."""
    device, grid, before, after, options = plan
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        _check_out(out, shape, dtype, device)
    if out.numel():
        launch(kernel, grid, before + (out,) + after, device, **options)
    return out


def dequantize_4bit(weight: Packed4bit, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes a 4-bit NF4/FP4 weight in one Triton launch, bit-exact with [`dequantize_4bit_ref`].

    The weight is validated on its first use per output dtype (the result is memoized on the container).

    Args:
        weight ([`Packed4bit`]): The packed weight (any storage dtype, any blocksize, optionally double-quantized).
        dtype (`torch.dtype`): Output dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        out (`torch.Tensor`, *optional*): Contiguous ``weight.shape`` tensor of ``dtype`` on the weight's device to
            write into (e.g. a reused buffer).

    Returns:
        `torch.Tensor`: The ``(out_features, in_features)`` weight in ``dtype`` (``out`` when given).
    """
    key = (dtype, weight.data.data_ptr(), weight.absmax.data_ptr())
    plan = _cached(weight, key, lambda: _plan_4bit(weight, dtype))
    return _run_plan(_dequant_4bit_kernel, plan, weight.shape, dtype, out)


def _plan_int8(weight: Int8Rowwise, dtype: torch.dtype) -> tuple:
    _check_dtype(dtype)
    check_int8(weight)
    device = weight.device
    _require_launchable(device)
    n_rows, n_cols = weight.shape
    block_k = min(next_power_of_2(max(n_cols, 1)), _INT8_BLOCK)
    block_n = _INT8_BLOCK // block_k
    grid = (cdiv(n_rows, block_n), cdiv(n_cols, block_k))
    after = (n_rows, n_cols, block_n, block_k, _is_interpreted(_dequant_int8_kernel))
    return device, grid, (weight.cb, weight.scb), after, dict(num_warps=_NUM_WARPS, enable_fp_fusion=False)


def dequantize_int8(weight: Int8Rowwise, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes a row-scaled int8 weight (``cb * scb[:, None] / 127``), bit-exact with [`dequantize_int8_ref`].

    Args:
        weight ([`Int8Rowwise`]): int8 codes ``(out_features, in_features)`` and fp32 row scales.
        dtype (`torch.dtype`): Output dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        out (`torch.Tensor`, *optional*): Contiguous ``weight.shape`` tensor of ``dtype`` to write into.

    Returns:
        `torch.Tensor`: The weight in ``dtype`` (``out`` when given).
    """
    key = (dtype, weight.cb.data_ptr(), weight.scb.data_ptr())
    plan = _cached(weight, key, lambda: _plan_int8(weight, dtype))
    return _run_plan(_dequant_int8_kernel, plan, weight.shape, dtype, out)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes either kind of quantized weight to ``dtype`` (see [`dequantize_4bit`], [`dequantize_int8`])."""
    if isinstance(weight, Packed4bit):
        return dequantize_4bit(weight, dtype, out)
    if isinstance(weight, Int8Rowwise):
        return dequantize_int8(weight, dtype, out)
    raise TypeError(f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}.")
