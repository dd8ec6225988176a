"""RMSNorm for training: Triton rows on CUDA ([`kernels.rms_norm`]), the pure-torch twins elsewhere.

The fast path routes the training forwards of its Liger-patched "llama"-cast norms here (``fast_norms.py``): the same
math as Liger's kernel, with a backward that runs at a copy's rate where Liger's walks rows one SM at a time
(``kernels/rms_norm.py`` says why). Only ``x`` is kept for backward; ``rstd`` is recomputed from it. The weight's
gradient (a trainable norm, rare under LoRA) is summed by torch in fp32 from the rounded normalised rows, as Liger
and transformers' own norm make it.
"""

from __future__ import annotations

import torch

from . import kernels, reference
from .dispatch import _use_triton
from .quant_state import FLOAT_DTYPES


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether [`rms_norm`] takes rows like ``x`` with ``weight``: float dtypes, and on the Triton path rows that fit
    one program (``kernels.rms_norm.MAX_BLOCK``)."""
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        return False
    return not _use_triton(x.device) or kernels.load().rms_norm.fits(x.shape[-1])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    if _use_triton(x.device):
        return kernels.load().rms_norm.rms_norm_forward(x, weight, eps, offset)
    return reference.rms_norm_ref(x, weight, eps, offset)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      offset: float = 0.0) -> torch.Tensor:  # fmt: skip
    if _use_triton(x.device):
        return kernels.load().rms_norm.rms_norm_backward(grad, x, weight, eps, offset)
    return reference.rms_norm_backward_ref(grad, x, weight, eps, offset)


def rms_norm_weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``sum over rows of grad * round(x * rstd)`` in fp32, returned in ``weight``'s dtype."""
    normed = (x.float() * reference._rstd(x, eps)).to(x.dtype)
    return (grad.float() * normed.float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x, weight, eps, offset)`` with autograd; keeps ``x`` (and ``weight``) for backward."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        return rms_norm_forward(x, weight, eps, offset)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = rms_norm_backward(grad, x, weight, ctx.eps, ctx.offset) if ctx.needs_input_grad[0] else None
        dw = rms_norm_weight_grad(grad, x, weight, ctx.eps) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of ``x`` (..., n) over its last dim, "llama" casting, in ``x``'s dtype: ``round(x * rstd) *
    (weight + offset)``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32.

    Args:
        x (`torch.Tensor`): fp16, bf16 or fp32 rows.
        weight (`torch.Tensor`): (n,), any float dtype; its gradient (if it needs one) comes back in its dtype.
        eps (`float`): Added to the mean square.
        offset (`float`, *optional*, defaults to 0.0): Added to the weight (1.0 for norms stored as ``w - 1``).
    """
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm needs `weight` of shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)}.")  # fmt: skip
    if not supports(x, weight):
        raise ValueError(f"rms_norm takes fp16/bf16/fp32 `x` and `weight` (on CUDA rows up to 32768 wide), got "
                         f"{x.dtype} x {x.shape[-1]} with a {weight.dtype} weight.")  # fmt: skip
    return RMSNormFunction.apply(x, weight, float(eps), float(offset))
