"""Triton SwiGLU, ``h = silu(gate) * up``, and its backward: the elementwise half of the fused MLP down projection
(``ops/swiglu_lora.py``), which recomputes ``h`` in backward instead of keeping it.

Math in fp32, one rounding per output, like ``reference.silu_mul_ref`` / ``silu_mul_backward_ref``:

    h  = g * sigmoid(g) * u
    dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du = dh * g * sigmoid(g)

Kernel -> launcher (views, allocates, launches); the launchers take same-shape contiguous tensors of one dtype,
checked by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, is_interpreted, launch, require_launchable

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    du = dh * silu
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, args: tuple, n: int, device: torch.device) -> None:
    require_launchable(kernel, device)
    block = BLOCK if not is_interpreted(kernel) else max(BLOCK, 1 << 16)  # the interpreter: few, large programs
    launch(kernel, (cdiv(n, block),), (*args, n, block), device, num_warps=NUM_WARPS)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in ``gate.dtype`` (fp32 math, one rounding)."""
    h = torch.empty_like(gate)
    if h.numel():
        _launch(_silu_mul_kernel, (gate, up, h), h.numel(), gate.device)
    return h


def silu_mul_backward(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *,
                      grad_h_is_scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(d gate, d up)`` of [`silu_mul`] for the gradient ``grad_h`` (fp32 math, one rounding each);
    ``grad_h_is_scratch``: the caller gives up ``grad_h`` (of ``gate``'s dtype), and d gate is written into it."""
    dg = grad_h if grad_h_is_scratch and grad_h.dtype == gate.dtype else torch.empty_like(gate)
    du = torch.empty_like(up)
    if dg.numel():
        _launch(_silu_mul_backward_kernel, (grad_h, gate, up, dg, du), dg.numel(), gate.device)
    return dg, du
