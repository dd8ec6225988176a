"""Triton SwiGLU, ``h = silu(gate) * up``, and its backward: the elementwise half of the fused MLP down projection
(``ops/swiglu_lora.py``), which recomputes ``h`` in backward instead of keeping it.

Math in fp32, one rounding per output, like ``reference.silu_mul_ref`` / ``silu_mul_backward_ref``:

    h  = g * sigmoid(g) * u
    dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du = dh * g * sigmoid(g)

Kernel -> launcher (views, allocates, launches); the launchers take same-shape tensors of one dtype, checked by the
caller: contiguous, or 2-D row-major views whose rows are further apart (the fused LoRA MLP reads and writes columns of
wider matrices, ``ops/lora_mlp.py``). Programs are (row, column block), so a row stride costs nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv, is_interpreted, launch, next_power_of_2, require_launchable

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, cols, g_stride, u_stride, h_stride, BLOCK: tl.constexpr):
    # grid (rows, column blocks): one row-major matrix each, rows `*_stride` elements apart (views of wider ones).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * h_stride + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, cols, dh_stride, g_stride, u_stride, dg_stride,
                              du_stride, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    dh = tl.load(dh_ptr + row * dh_stride + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    du = dh * silu
    tl.store(dg_ptr + row * dg_stride + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * du_stride + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a (rows, columns) view with unit column stride (contiguous tensors of any rank, or 2-D views of the
    first columns of a wider matrix, as the fused LoRA MLP passes)."""
    rows = t if t.dim() == 2 else t.view(-1, t.shape[-1]) if t.dim() else t.view(1, 1)
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"expected unit column stride, got a {tuple(t.shape)} tensor with strides {t.stride()}")
    return rows


def _launch(kernel, tensors: tuple, device: torch.device) -> None:
    require_launchable(kernel, device)
    rows, cols = tensors[0].shape
    # the interpreter: few, large programs (one per row)
    block = BLOCK if not is_interpreted(kernel) else max(BLOCK, next_power_of_2(cols))
    strides = tuple(t.stride(0) for t in tensors)
    launch(kernel, (rows, cdiv(cols, block)), (*tensors, cols, *strides, block), device, num_warps=NUM_WARPS)


def _out(like: torch.Tensor, out: Optional[torch.Tensor], name: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"`{name}` must be a {tuple(like.shape)} {like.dtype} tensor on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}.")  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up`` in ``gate.dtype`` (fp32 math, one rounding), into ``out`` when given (a tensor like
    ``gate``, whose rows may be further apart: the first columns of a wider matrix)."""
    h = _out(gate, out, "out")
    if h.numel():
        _launch(_silu_mul_kernel, (_rows(gate), _rows(up), _rows(h)), gate.device)
    return h


def silu_mul_backward(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, grad_h_is_scratch: bool = False,
                      out_up: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(d gate, d up)`` of [`silu_mul`] for the gradient ``grad_h`` (fp32 math, one rounding each);
    ``grad_h_is_scratch``: the caller gives up ``grad_h`` (of ``gate``'s dtype), and d gate is written into it;
    ``out_up``: where to write d up (a tensor like ``up``, rows possibly further apart)."""
    dg = grad_h if grad_h_is_scratch and grad_h.dtype == gate.dtype else torch.empty_like(gate)
    du = _out(up, out_up, "out_up")
    if dg.numel():
        tensors = (_rows(grad_h), _rows(gate), _rows(up), _rows(dg), _rows(du))
        _launch(_silu_mul_backward_kernel, tensors, gate.device)
    return dg, du
