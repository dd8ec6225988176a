"""The kernels as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces FastLoRA layers whole.

Custom ops take only tensors and scalars, so a quantized weight travels as its fields (``WEIGHT_FIELDS``; ``code is
None`` marks an ``Int8Rowwise``). Every op has a fake (meta) implementation for tracing; ``lora_linear`` has an
autograd formula whose backward is itself an op, so AOTAutograd can trace it too. The ops run on any device: the
implementations call the same launchers as the eager path.
"""

# No `from __future__ import annotations`: custom_op infers each op's schema from real (not string) annotations.
from typing import Optional

import torch
from torch import Tensor

from .lora_linear import dequantize_kernel, lora_linear_backward, lora_linear_forward
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight

# (qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, out_features, in_features,
#  quant_type): the order in which every op below takes a flattened weight, after its own arguments.
WEIGHT_FIELDS = 11


def flatten_weight(weight: QuantizedWeight) -> tuple:
    """The fields of a quantized weight in the order the ops take them."""
    n, k = weight.shape
    if isinstance(weight, Int8Rowwise):
        return (weight.cb, weight.scb, None, None, None, None, 0, 0, n, k, "int8")
    return (
        weight.data,
        weight.absmax,
        weight.code,
        weight.nested_absmax,
        weight.nested_code,
        weight.offset,
        weight.blocksize,
        weight.nested_blocksize,
        n,
        k,
        weight.quant_type,
    )


def unflatten_weight(
    qdata: Tensor,
    qscale: Tensor,
    code: Optional[Tensor],
    nested_absmax: Optional[Tensor],
    nested_code: Optional[Tensor],
    offset: Optional[Tensor],
    blocksize: int,
    nested_blocksize: int,
    out_features: int,
    in_features: int,
    quant_type: str,
) -> QuantizedWeight:
    """Inverse of [`flatten_weight`]."""
    if code is None:
        return Int8Rowwise(cb=qdata, scb=qscale)
    return Packed4bit(
        data=qdata,
        absmax=qscale,
        code=code,
        blocksize=int(blocksize),
        shape=(int(out_features), int(in_features)),
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=int(nested_blocksize),
        offset=offset,
        quant_type=quant_type,
    )


# ---- dequantize ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("peft_fastlora::dequantize", mutates_args=())
def dequantize_op(
    dtype: torch.dtype,
    qdata: Tensor,
    qscale: Tensor,
    code: Optional[Tensor],
    nested_absmax: Optional[Tensor],
    nested_code: Optional[Tensor],
    offset: Optional[Tensor],
    blocksize: int,
    nested_blocksize: int,
    out_features: int,
    in_features: int,
    quant_type: str,
) -> Tensor:
    weight = unflatten_weight(qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                              out_features, in_features, quant_type)  # fmt: skip
    return dequantize_kernel(weight, dtype)


@dequantize_op.register_fake
def _(dtype, qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize, n, k, quant_type):
    return qdata.new_empty((n, k), dtype=dtype)


# ---- lora_linear (training path) -----------------------------------------------------------------------------------
@torch.library.custom_op("peft_fastlora::lora_linear", mutates_args=())
def lora_linear_op(
    x: Tensor,
    bias: Optional[Tensor],
    lora_a: Optional[Tensor],
    lora_b: Optional[Tensor],
    lora_x: Optional[Tensor],
    scaling: float,
    qdata: Tensor,
    qscale: Tensor,
    code: Optional[Tensor],
    nested_absmax: Optional[Tensor],
    nested_code: Optional[Tensor],
    offset: Optional[Tensor],
    blocksize: int,
    nested_blocksize: int,
    out_features: int,
    in_features: int,
    quant_type: str,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, xa)``; ``xa = lora_x @ A.T`` (``(*x.shape[:-1], r)``) is an output so that backward can reuse
    it (empty if no LoRA). ``lora_x=None`` means the LoRA branch reads ``x``."""
    weight = unflatten_weight(qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                              out_features, in_features, quant_type)  # fmt: skip
    out, xa = lora_linear_forward(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    return out, (x.new_empty(0) if xa is None else xa.view(*x.shape[:-1], xa.shape[-1]))


@lora_linear_op.register_fake
def _(x, bias, lora_a, lora_b, lora_x, scaling, *weight_fields):
    n = weight_fields[8]
    r = 0 if lora_a is None else lora_a.shape[0]
    xa = x.new_empty(0) if lora_a is None else x.new_empty((*x.shape[:-1], r))
    return x.new_empty((*x.shape[:-1], n)), xa


def _setup_context(ctx, inputs, output):
    x, bias, lora_a, lora_b, lora_x, scaling = inputs[:6]
    ctx.weight_fields = inputs[6:]
    ctx.scaling = scaling
    ctx.separate = lora_x is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    need_da = lora_a is not None and ctx.needs_input_grad[2]
    lora_input = (lora_x if ctx.separate else x) if need_da else None
    xa = output[1] if lora_a is not None else None
    ctx.save_for_backward(lora_input, xa, lora_a, lora_b)


def _backward(ctx, grad_out, grad_xa):
    lora_input, xa, lora_a, lora_b = ctx.saved_tensors
    nig = ctx.needs_input_grad
    grads = lora_linear_backward_op(
        grad_out, grad_xa if lora_a is not None else None, lora_a, lora_b, lora_input, xa, ctx.bias_dtype,
        ctx.scaling, nig[0], ctx.separate and nig[4], nig[2], nig[3], nig[1], ctx.separate, *ctx.weight_fields,
    )  # fmt: skip
    needed = (nig[0], nig[1], nig[2], nig[3], ctx.separate and nig[4])
    dx, dbias, da, db, dlx = (g if need else None for g, need in zip(grads, needed))
    return (dx, dbias, da, db, dlx) + (None,) * (1 + WEIGHT_FIELDS)


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
    need_dx: bool,
    need_dlx: bool,
    need_da: bool,
    need_db: bool,
    need_dbias: bool,
    separate_lora_x: bool,
    qdata: Tensor,
    qscale: Tensor,
    code: Optional[Tensor],
    nested_absmax: Optional[Tensor],
    nested_code: Optional[Tensor],
    offset: Optional[Tensor],
    blocksize: int,
    nested_blocksize: int,
    out_features: int,
    in_features: int,
    quant_type: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx, dbias, dA, dB, dlora_x)``; grads that are not needed come back as empty tensors."""
    weight = unflatten_weight(qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                              out_features, in_features, quant_type)  # fmt: skip
    needs = (need_dx, need_dlx, need_da, need_db, need_dbias)
    dx, dlx, da, db, dbias = lora_linear_backward(
        grad_out, weight, lora_a, lora_b, scaling, lora_input, xa, bias_dtype, needs, separate_lora_x, grad_xa
    )
    # Placeholders must be distinct tensors: custom op outputs may not alias each other.
    return tuple(grad_out.new_empty(0) if g is None else g for g in (dx, dbias, da, db, dlx))


@lora_linear_backward_op.register_fake
def _(grad_out, grad_xa, lora_a, lora_b, lora_input, xa, bias_dtype, scaling, need_dx, need_dlx, need_da, need_db,
      need_dbias, separate_lora_x, *weight_fields):  # fmt: skip
    n, k = weight_fields[8], weight_fields[9]
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
def fused_small_m_kernel():
    """The fused small-M decode kernel (``fused_lora_linear_small_m``), imported on first use."""
    from .fused_small_m import fused_lora_linear_small_m  # imports Triton: only on the Triton paths

    return fused_lora_linear_small_m


@torch.library.custom_op("peft_fastlora::lora_linear_small_m", mutates_args=())
def lora_linear_small_m_op(
    x: Tensor,
    bias: Optional[Tensor],
    lora_a: Optional[Tensor],
    lora_b: Optional[Tensor],
    lora_x: Optional[Tensor],
    scaling: float,
    qdata: Tensor,
    qscale: Tensor,
    code: Optional[Tensor],
    nested_absmax: Optional[Tensor],
    nested_code: Optional[Tensor],
    offset: Optional[Tensor],
    blocksize: int,
    nested_blocksize: int,
    out_features: int,
    in_features: int,
    quant_type: str,
) -> Tensor:
    weight = unflatten_weight(qdata, qscale, code, nested_absmax, nested_code, offset, blocksize, nested_blocksize,
                              out_features, in_features, quant_type)  # fmt: skip
    return fused_small_m_kernel()(x, weight, bias, lora_a, lora_b, scaling, lora_x)


@lora_linear_small_m_op.register_fake
def _(x, bias, lora_a, lora_b, lora_x, scaling, *weight_fields):
    return x.new_empty((*x.shape[:-1], weight_fields[8]))
