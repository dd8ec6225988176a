"""``@triton.jit`` helpers shared by the dequant kernels and the fused small-M kernel.

They decode bitsandbytes' formats exactly: fp32 math, a nested (double-quantized) scale as a multiply then an add
(two roundings, never an FMA), and one final round-to-nearest-even to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant_state import INT8_INV_127

# Kernels may only read globals that are constexpr.
INV_127 = tl.constexpr(INT8_INV_127)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
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
def mul_rn(a, b):
    """``a * b`` in fp32, rounded once: PTX ``mul.rn`` is never fused with a following add (CUDA only)."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def decode_nibbles(packed, code_ptr):
    """uint8 codes -> (value of the high nibble, value of the low nibble) as fp32 ``code`` entries."""
    packed = packed.to(tl.int32)
    high = tl.load(code_ptr + (packed >> 4))
    low = tl.load(code_ptr + (packed & 0xF))
    return high, low


@triton.jit
def decode_absmax(
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
            scale = mul_rn(nested_value, nested_scale)
        else:
            scale = nested_value * nested_scale
        scale = scale + tl.load(offset_ptr)
    else:
        scale = raw
    return scale


@triton.jit
def load_absmax(
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
    return decode_absmax(raw, block_idx, mask, nested_code_ptr, nested_absmax_ptr, offset_ptr, NESTED, NESTED_BLOCKSIZE)
