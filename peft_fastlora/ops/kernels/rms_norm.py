"""Triton RMSNorm of rows, ``y = round(x * rstd) * (w + offset)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``, and
its input gradient: one program per row in both directions.

Why not Liger-Kernel's RMSNorm backward, which the fast path otherwise uses: it runs one program per SM, each walking
its share of the rows one after the other, so that it can sum the weight's gradient in registers; a decoder's norms
are frozen under LoRA, so that sum is never asked for, and with one row in flight per SM the pass reads HBM at about
half a copy's rate (94 us for dx of 8,192 x 4,096 bf16 rows on an H200; 50 us here, where the three 64 MB passes
take ~48 us at the copy's rate). Here every row is its own program, the backward recomputes ``rstd`` from the row it
reads anyway (nothing but ``x`` is kept for it), and the weight's gradient, when one is needed, is left to torch
(``ops/rms_norm.py``).

Math ("llama" casting, as transformers' Llama/Mistral/Qwen norms and Liger's ``casting_mode="llama"``): ``x`` in
fp32 for the mean and the product with ``rstd``, rounded to ``x.dtype`` before the weight multiplies it (one more
rounding to the output dtype); backward in fp32 with ``m = dy * (w + offset)``:
``dx = rstd * m - rstd^3 / n * sum(m * x) * x``.

Kernel -> launcher (views, allocates, launches); twins: ``reference.rms_norm_ref`` and
``reference.rms_norm_backward_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jit import round_to
from .launch import is_interpreted, launch, next_power_of_2, require_launchable

MAX_BLOCK = 32768  # a whole row in one program's registers; wider rows stay with the caller's other path


@triton.jit
def _rms_norm_rows_forward_kernel(y_ptr, x_ptr, w_ptr, cols, eps, offset, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols_ = tl.arange(0, BLOCK)
    inside = cols_ < cols
    x = tl.load(x_ptr + row * cols + cols_, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols_, mask=inside, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
    normed = round_to(x * rstd, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    tl.store(y_ptr + row * cols + cols_, round_to(normed * w, y_ptr.dtype.element_ty, INTERPRET), mask=inside)


@triton.jit
def _rms_norm_rows_backward_kernel(dx_ptr, dy_ptr, x_ptr, w_ptr, cols, eps, offset, BLOCK: tl.constexpr,
                                   INTERPRET: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols_ = tl.arange(0, BLOCK)
    inside = cols_ < cols
    x = tl.load(x_ptr + row * cols + cols_, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * cols + cols_, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols_, mask=inside, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
    m = dy * w
    dx = rstd * m - (rstd * rstd * rstd / cols) * tl.sum(m * x, axis=0) * x
    tl.store(dx_ptr + row * cols + cols_, round_to(dx, dx_ptr.dtype.element_ty, INTERPRET), mask=inside)


def fits(cols: int) -> bool:
    """Whether rows ``cols`` wide fit one program of [`rms_norm_forward`] / [`rms_norm_backward`]."""
    return next_power_of_2(cols) <= MAX_BLOCK


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``y`` (``x``'s shape and dtype) of ``x`` (..., n) normalised over its last dim with ``weight`` (n,)."""
    cols = x.shape[-1]
    x2d = x.reshape(-1, cols).contiguous()
    y = torch.empty_like(x2d)
    if x2d.shape[0] and cols:
        require_launchable(_rms_norm_rows_forward_kernel, x.device)
        block = next_power_of_2(cols)
        args = (y, x2d, weight.contiguous(), cols, float(eps), float(offset), block,
                is_interpreted(_rms_norm_rows_forward_kernel))
        launch(_rms_norm_rows_forward_kernel, (x2d.shape[0],), args, x.device, num_warps=_num_warps(block))
    return y.view(x.shape)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      offset: float = 0.0) -> torch.Tensor:  # fmt: skip
    """``dx`` (``x``'s shape and dtype) of [`rms_norm_forward`] for the output gradient ``grad`` (``x``'s shape)."""
    cols = x.shape[-1]
    x2d = x.reshape(-1, cols).contiguous()
    dy = grad.reshape(-1, cols).contiguous()
    dx = torch.empty_like(x2d)
    if x2d.shape[0] and cols:
        require_launchable(_rms_norm_rows_backward_kernel, x.device)
        block = next_power_of_2(cols)
        args = (dx, dy, x2d, weight.contiguous(), cols, float(eps), float(offset), block,
                is_interpreted(_rms_norm_rows_backward_kernel))
        launch(_rms_norm_rows_backward_kernel, (x2d.shape[0],), args, x.device, num_warps=_num_warps(block))
    return dx.view(x.shape)
