"""The kernels as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces FastLoRA layers whole.

Custom ops take only tensors, scalars and lists of them, so a quantized weight crosses the boundary as its fields,
``(weight_tensors: Tensor[], weight_meta: int[], quant_type: str)`` from ``weight.to_fields()``, rebuilt inside by
``weight_from_fields``. The ops take the same arguments in the same order as the eager path
(``lora_linear.LoraLinearFunction``), with the weight's fields last.

Every op has a fake (meta) implementation for tracing, and none syncs with the host or keeps Python state between
calls, so compiled graphs can be captured as CUDA graphs (``mode="reduce-overhead"``). ``lora_linear`` has an
autograd formula whose backward is itself an op, so AOTAutograd can trace it too. The ops run on any device: the
implementations call the same launchers as the eager path; their arguments were checked at the door
(``dispatch.py``) before the op was traced.
"""

# No `from __future__ import annotations`: custom_op infers each op's schema from real (not string) annotations.
from typing import Optional

import torch
from torch import Tensor

from . import kernels
from .lora_linear import PLAIN_LAYER_WINDOWS, lora_linear_backward, lora_linear_forward, needed_grads, save_for_backward
from .quant_state import weight_from_fields


# ---- dequantize ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("peft_fastlora::dequantize", mutates_args=())
def dequantize_op(
    dtype: torch.dtype, weight_tensors: list[Tensor], weight_meta: list[int], quant_type: str
) -> Tensor:
    weight = weight_from_fields(weight_tensors, weight_meta, quant_type)
    return kernels.load().dequant.dequantize_triton(weight, dtype)


@dequantize_op.register_fake
def _(dtype, weight_tensors, weight_meta, quant_type):
    return weight_tensors[0].new_empty((weight_meta[0], weight_meta[1]), dtype=dtype)


# ---- lora_linear (training path) -----------------------------------------------------------------------------------
@torch.library.custom_op("peft_fastlora::lora_linear", mutates_args=())
def lora_linear_op(
    x: Tensor,
    bias: Optional[Tensor],
    lora_a: Optional[Tensor],
    lora_b: Optional[Tensor],
    scaling: float,
    lora_x: Optional[Tensor],
    weight_tensors: list[Tensor],
    weight_meta: list[int],
    quant_type: str,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, xa)``; ``xa = lora_x @ A.T`` (``(*x.shape[:-1], r)``) is an output so that backward can reuse
    it (empty if no LoRA)."""
    weight = weight_from_fields(weight_tensors, weight_meta, quant_type)
    out, xa = lora_linear_forward(x, bias, lora_a, lora_b, scaling, lora_x, weight, PLAIN_LAYER_WINDOWS)
    return out, (x.new_empty(0) if xa is None else xa.view(*x.shape[:-1], xa.shape[-1]))


@lora_linear_op.register_fake
def _(x, bias, lora_a, lora_b, scaling, lora_x, weight_tensors, weight_meta, quant_type):
    xa = x.new_empty(0) if lora_a is None else x.new_empty((*x.shape[:-1], lora_a.shape[0]))
    return x.new_empty((*x.shape[:-1], weight_meta[0])), xa


def _setup_context(ctx, inputs, output):
    x, bias, lora_a, lora_b, scaling, lora_x, *weight_fields = inputs
    save_for_backward(ctx, x, bias, lora_a, lora_b, scaling, lora_x, output[1] if lora_a is not None else None)
    ctx.weight_fields = weight_fields


def _backward(ctx, grad_out, grad_xa):
    lora_input, xa, lora_a, lora_b = ctx.saved_tensors
    needs = list(needed_grads(ctx))
    grads = lora_linear_backward_op(grad_out, grad_xa if lora_a is not None else None, lora_a, lora_b, lora_input, xa,
                                    ctx.bias_dtype, ctx.scaling, needs, ctx.separate, *ctx.weight_fields)  # fmt: skip
    dx, dbias, da, db, dlx = (g if need else None for g, need in zip(grads, needs))
    no_grads = [None] * len(ctx.weight_fields[0])  # one per weight tensor: the structure of the input list
    return dx, dbias, da, db, None, dlx, no_grads, None, None


@torch.library.custom_op("peft_fastlora::lora_linear_backward", mutates_args=())
def lora_linear_backward_op(
    grad_out: Tensor,
    grad_xa: Optional[Tensor],
    lora_a: Optional[Tensor],
    lora_b: Optional[Tensor],
    lora_input: Optional[Tensor],
    xa: Optional[Tensor],
    bias_dtype: Optional[torch.dtype],
    scaling: float,
    needs: list[bool],
    separate_lora_x: bool,
    weight_tensors: list[Tensor],
    weight_meta: list[int],
    quant_type: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx, dbias, dA, dB, dlora_x)``; grads that are not needed come back as empty tensors."""
    weight = weight_from_fields(weight_tensors, weight_meta, quant_type)
    grads = lora_linear_backward(grad_out, grad_xa, lora_a, lora_b, lora_input, xa, bias_dtype, scaling, tuple(needs),
                                 separate_lora_x, weight, max_windows=PLAIN_LAYER_WINDOWS)  # fmt: skip
    # Placeholders must be distinct tensors: custom op outputs may not alias each other.
    return tuple(grad_out.new_empty(0) if g is None else g for g in grads)


@lora_linear_backward_op.register_fake
def _(grad_out, grad_xa, lora_a, lora_b, lora_input, xa, bias_dtype, scaling, needs, separate_lora_x, weight_tensors,
      weight_meta, quant_type):  # fmt: skip
    need_dx, need_dbias, need_da, need_db, need_dlx = needs
    n, k = weight_meta[0], weight_meta[1]
    lora = lora_a is not None
    dx_shape = (*grad_out.shape[:-1], k)
    return (
        grad_out.new_empty(dx_shape if need_dx else 0),
        grad_out.new_empty(n if need_dbias else 0, dtype=bias_dtype),
        torch.empty_like(lora_a) if lora and need_da else grad_out.new_empty(0),
        torch.empty_like(lora_b) if lora and need_db else grad_out.new_empty(0),
        grad_out.new_empty(dx_shape if lora and need_dlx and separate_lora_x else 0),
    )


lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


# ---- fused small-M forward (decode; no autograd) ------------------------------------------------------------------
@torch.library.custom_op("peft_fastlora::lora_linear_small_m", mutates_args=())
def lora_linear_small_m_op(
    x: Tensor,
    bias: Optional[Tensor],
    lora_a: Optional[Tensor],
    lora_b: Optional[Tensor],
    scaling: float,
    lora_x: Optional[Tensor],
    weight_tensors: list[Tensor],
    weight_meta: list[int],
    quant_type: str,
) -> Tensor:
    weight = weight_from_fields(weight_tensors, weight_meta, quant_type)
    return kernels.load().small_m.small_m_linear(x, weight, bias, lora_a, lora_b, scaling, lora_x)


@lora_linear_small_m_op.register_fake
def _(x, bias, lora_a, lora_b, scaling, lora_x, weight_tensors, weight_meta, quant_type):
    return x.new_empty((*x.shape[:-1], weight_meta[0]))
