"""Pure-torch twins of every Triton op: the CPU path and the test oracle.

Each function has the same signature as its kernel counterpart. Math is done in fp32 and rounded once to the
requested dtype, which is what bitsandbytes' own dequantization does, so these results are bit-exact with it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight

# bitsandbytes divides by 127 as a multiply by this fp32 reciprocal; using the same constant keeps us bit-exact.
INT8_INV_127 = 7.874015718698502e-3


def _blockwise_scale(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``values[i] * scales[i // blocksize]`` in fp32 for a flat ``values`` of any length."""
    n = values.numel()
    per_element = scales.float().repeat_interleave(blocksize)[:n]
    return values.float() * per_element


def decode_absmax(weight: Packed4bit) -> torch.Tensor:
    """Returns the fp32 per-block scales, decoding the double-quantized absmax when present."""
    if not weight.nested:
        return weight.absmax.float()
    codes = weight.nested_code[weight.absmax.reshape(-1).long()]
    absmax = _blockwise_scale(codes, weight.nested_absmax, weight.nested_blocksize)
    return absmax + weight.offset.float()


def dequantize_4bit_ref(weight: Packed4bit, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes a 4-bit weight to ``dtype`` (shape ``weight.shape``), math in fp32 with one final rounding."""
    n = weight.numel
    packed = weight.data.contiguous().reshape(-1).view(torch.uint8)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(-1)[:n]
    values = weight.code.float()[nibbles.long()]
    return _blockwise_scale(values, decode_absmax(weight), weight.blocksize).reshape(weight.shape).to(dtype)


def dequantize_int8_ref(weight: Int8Rowwise, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes a row-scaled int8 weight: ``cb * scb[:, None] / 127`` in fp32, rounded once to ``dtype``."""
    return (weight.cb.float() * weight.scb.float().view(-1, 1) * INT8_INV_127).to(dtype)


def dequantize_ref(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes either kind of quantized weight to ``dtype``."""
    if isinstance(weight, Packed4bit):
        return dequantize_4bit_ref(weight, dtype)
    return dequantize_int8_ref(weight, dtype)


def lora_linear_ref(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T @ B.T)`` with ``y.dtype == x.dtype``.

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32; W is dequantized to this dtype.
        weight: The quantized base weight ``(out_features, in_features)``.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``, cast to ``x.dtype``.
        lora_a (`torch.Tensor`, *optional*): ``(r, in_features)``; with ``lora_b`` ``(out_features, r)``. The LoRA
            term is computed in the adapter dtype and cast to ``x.dtype``. ``None`` skips it.
        scaling (`float`): LoRA scaling (``alpha / r``).
        lora_x (`torch.Tensor`, *optional*): Input of the LoRA branch (e.g. after dropout); defaults to ``x``.
    """
    w = dequantize_ref(weight, x.dtype)
    out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
    if lora_a is not None:
        lx = x if lora_x is None else lora_x
        lora = F.linear(F.linear(lx.to(lora_a.dtype), lora_a), lora_b.to(lora_a.dtype)) * scaling
        out = out + lora.to(x.dtype)
    return out
