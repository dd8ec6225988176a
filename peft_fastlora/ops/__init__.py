"""Kernels behind FastLoRA layers, and the one place that picks which implementation runs.

Dispatch of [`fastlora_linear`]:

- autocast on: ``x`` (and ``lora_x``) are cast to the autocast dtype first, as ``nn.Linear`` would be, and the op runs
  with autocast off;
- tensors not on CUDA: the pure-torch reference (plain autograd), unless ``PEFT_FASTLORA_FORCE_TRITON=1`` (tests run
  the Triton path under the interpreter that way);
- no grad needed and at most as many rows as the measured crossover for this GPU and shape (``tuned.py``; else
  ``SMALL_M_MAX``): the fused small-M decode kernel;
- otherwise: [`LoraLinearFunction`] (dequantize + cuBLAS, W not saved for backward).

Under ``torch.compile`` the Triton paths go through the ``torch.ops.peft_fastlora`` custom ops instead, so that
``fullgraph=True`` holds; eagerly they are called directly, which keeps the per-call overhead to plain Python.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from . import custom_ops
from .lora_linear import LoraLinearFunction, check_lora_linear_args, dequantize_kernel
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight
from .reference import dequantize_ref, lora_linear_ref

__all__ = [
    "Int8Rowwise",
    "LoraLinearFunction",
    "Packed4bit",
    "QuantizedWeight",
    "dequantize",
    "fastlora_linear",
    "small_m_max",
]

FORCE_TRITON_ENV = "PEFT_FASTLORA_FORCE_TRITON"


def _force_triton() -> bool:
    return os.environ.get(FORCE_TRITON_ENV, "0") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _force_triton()


@functools.cache
def _fused():
    """The fused small-M module, imported on first use (it imports Triton: only the Triton paths need it)."""
    from . import fused_small_m

    return fused_small_m


def small_m_max() -> int:
    """Rows up to which the fused small-M kernel is used for a weight with no measured crossover (``tuned.py``)."""
    from .fused_small_m import SMALL_M_MAX  # imports Triton: only on the Triton paths

    return SMALL_M_MAX


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes a [`Packed4bit`] or [`Int8Rowwise`] weight to ``dtype``: Triton on CUDA, the reference elsewhere.

    Args:
        weight: The quantized weight, shape ``(out_features, in_features)``.
        dtype (`torch.dtype`): Output dtype (fp16, bf16 or fp32).
    """
    if not isinstance(weight, (Packed4bit, Int8Rowwise)):
        raise TypeError(f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}.")
    if not (weight.device.type == "cuda" or _force_triton()):
        return dequantize_ref(weight, dtype)
    if torch.compiler.is_compiling():
        return custom_ops.dequantize_op(dtype, *custom_ops.flatten_weight(weight))
    return dequantize_kernel(weight, dtype)


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x):
    check_lora_linear_args(x, weight, bias, lora_a, lora_b, lora_x)
    if not _use_triton(x):
        return lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    if lora_a is None or lora_x is x:
        lora_x = None  # the LoRA branch reads x; its grad then goes straight into dx
    elif lora_x is not None and lora_x.dtype != x.dtype:
        lora_x = lora_x.to(x.dtype)
    scaling = float(scaling)
    compiling = torch.compiler.is_compiling()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not _needs_grad(x, lora_x, lora_a, lora_b, bias) and rows <= _fused().small_m_limit(weight, x.device):
        if compiling:
            fields = custom_ops.flatten_weight(weight)
            return custom_ops.lora_linear_small_m_op(x, bias, lora_a, lora_b, lora_x, scaling, *fields)
        return _fused().small_m_forward(x, weight, bias, lora_a, lora_b, scaling, lora_x)  # checked above
    if compiling:
        fields = custom_ops.flatten_weight(weight)
        return custom_ops.lora_linear_op(x, bias, lora_a, lora_b, lora_x, scaling, *fields)[0]
    return LoraLinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling, lora_x, False)  # checked above


def fastlora_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T) @ B.T`` with ``y.dtype == x.dtype``.

    Same signature and semantics as [`~peft_fastlora.ops.reference.lora_linear_ref`]; picks the implementation
    (see the module docstring). Grads of fp32 adapters used with fp16/bf16 activations come back in fp32.

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32; W is dequantized to this dtype.
        weight: The quantized base weight ``(out_features, in_features)``, on ``x``'s device.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``.
        lora_a (`torch.Tensor`, *optional*): ``(r, in_features)``; with ``lora_b`` ``(out_features, r)``. ``None``
            skips the LoRA term.
        scaling (`float`): LoRA scaling (``alpha / r``).
        lora_x (`torch.Tensor`, *optional*): Input of the LoRA branch (e.g. after dropout); defaults to ``x``.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    dtype = torch.get_autocast_dtype(device_type)
    if lora_x is x:
        lora_x = None  # before x is cast: the LoRA branch keeps reading x
    elif lora_x is not None and lora_x.dtype != dtype:
        lora_x = lora_x.to(dtype)
    if x.dtype != dtype:
        x = x.to(dtype)
    if torch.compiler.is_compiling():
        with torch.autocast(device_type, enabled=False):
            return _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    # Eagerly, flip the flag instead of entering `torch.autocast(enabled=False)`: its constructor alone costs more host
    # time than a kernel launch, on every layer of every step.
    torch.set_autocast_enabled(device_type, False)
    try:
        return _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    finally:
        torch.set_autocast_enabled(device_type, True)
