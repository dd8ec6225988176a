"""Triton SwiGLU, ``h = silu(gate) * up``, and its backward: the elementwise half of the fused MLP down projection
(``ops/swiglu_lora.py``), which keeps ``gate`` and ``up`` for backward instead of ``h``.

Math in fp32, one rounding per output, like ``reference.silu_mul_ref`` / ``silu_mul_backward_ref``:

    h  = g * sigmoid(g) * u
    dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du = dh * g * sigmoid(g)

Kernel -> launcher (views, allocates, launches); the launchers take same-shape tensors of one dtype, checked by the
caller: contiguous, or 2-D row-major views whose rows are further apart (the fused LoRA MLP reads and writes columns of
wider matrices, ``ops/lora_mlp.py``). Programs are (row, column block), so a row stride costs nothing.

The down projection's LoRA grad ``dA = t.T @ h`` (``t = s g @ B``, (M, r)) is the one use of ``h`` in backward.
[`silu_mul_backward_lora`] computes it in the pass that reads ``gate`` and ``up`` for their grads anyway, from ``h``
rounded as [`silu_mul`] rounds it, so that ``h`` is neither recomputed into memory nor read back (at 8,192 tokens of
a Llama-3-8B MLP that was a 235 MB write and two 235 MB reads per layer); [`silu_mul_t_matmul`] is the same
product alone, for when gate and up need no grad. Programs are (column block, row split): each walks its rows,
accumulating its columns of ``t.T @ h`` in fp32, and the splits' partial sums are added in a fixed order (no atomics:
the result does not change from run to run).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .jit import round_to
from .launch import cdiv, is_interpreted, launch, next_power_of_2, require_launchable

BLOCK = 1024
NUM_WARPS = 4
# t.T @ h kernels: (LORA_BLOCK_M x LORA_BLOCK_N) tiles, rows in up to MAX_SPLITS splits of at least MIN_SPLIT_ROWS.
# H100, 14336 columns, r = 16 (probe of 1/2/4/8 splits x 32/64 rows x 4/8 warps): 2 splits of 32-row tiles with 8
# warps were fastest or within 1 % at 2,048 and 8,192 rows (141 / 522 us; 8 splits of 4 warps 154 / 551 us), and the
# fp32 partial sums (splits x r x columns, 1.8 MB here) are allocated while the backward is at its peak.
LORA_BLOCK_M = 32
LORA_BLOCK_N = 128
LORA_NUM_WARPS = 8
MAX_SPLITS = 2
MIN_SPLIT_ROWS = 256


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, cols, g_stride, u_stride, h_stride, BLOCK: tl.constexpr,
                     INTERPRET: tl.constexpr):  # fmt: skip
    # grid (rows, column blocks): one row-major matrix each, rows `*_stride` elements apart (views of wider ones).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * h_stride + offs, round_to(h, h_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, cols, dh_stride, g_stride, u_stride, dg_stride,
                              du_stride, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
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
    tl.store(dg_ptr + row * dg_stride + offs, round_to(dg, dg_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(du_ptr + row * du_stride + offs, round_to(du, du_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _silu_mul_lora_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, t_ptr, ws_ptr, rows, cols, rank, rows_per_split,
                          dh_stride, g_stride, u_stride, dg_stride, du_stride, t_stride, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GRAD_H: tl.constexpr,
                          INTERPRET: tl.constexpr):  # fmt: skip
    # grid (column blocks, row splits). ws[split, :rank, cols] = t[rows of split].T @ h[rows of split]; with GRAD_H
    # also d gate / d up of those rows (d gate may be written over dh: each element is read before it is written).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    in_n, in_r = offs_n < cols, offs_r < rank
    row_begin = split * rows_per_split
    row_end = tl.minimum(row_begin + rows_per_split, rows)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_begin, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < row_end
        row = offs_m.to(tl.int64)[:, None]
        mask = in_m[:, None] & in_n[None, :]
        g = tl.load(g_ptr + row * g_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        h = round_to(silu * u, g_ptr.dtype.element_ty, INTERPRET)  # h as silu_mul writes it
        if GRAD_H:
            dh = tl.load(dh_ptr + row * dh_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            dg = dh * u * sig * (1.0 + g * (1.0 - sig))
            tl.store(dg_ptr + row * dg_stride + offs_n[None, :], round_to(dg, dg_ptr.dtype.element_ty, INTERPRET),
                     mask=mask)  # fmt: skip
            tl.store(du_ptr + row * du_stride + offs_n[None, :],
                     round_to(dh * silu, du_ptr.dtype.element_ty, INTERPRET), mask=mask)  # fmt: skip
        t = tl.load(t_ptr + offs_m.to(tl.int64)[None, :] * t_stride + offs_r[:, None],
                    mask=in_r[:, None] & in_m[None, :], other=0.0)  # fmt: skip
        if INTERPRET:  # the interpreter's 16-bit tl.dot is wrong; fp32 holds 16-bit products exactly
            acc = tl.dot(t.to(tl.float32), h.to(tl.float32), acc)
        elif t_ptr.dtype.element_ty == tl.float32:  # fp32 activations: fp32 products, as torch.mm (not TF32)
            acc = tl.dot(t, h, acc, input_precision="ieee")
        else:
            acc = tl.dot(t, h, acc)
    ws = ws_ptr + split.to(tl.int64) * rank * cols + offs_r[:, None] * cols + offs_n[None, :]
    tl.store(ws, acc, mask=in_r[:, None] & in_n[None, :])


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
    interpret = is_interpreted(kernel)
    block = BLOCK if not interpret else max(BLOCK, next_power_of_2(cols))
    strides = tuple(t.stride(0) for t in tensors)
    launch(kernel, (rows, cdiv(cols, block)), (*tensors, cols, *strides, block, interpret), device,
           num_warps=NUM_WARPS)  # fmt: skip


def _out(like: torch.Tensor, out: Optional[torch.Tensor], name: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"`{name}` must be a {tuple(like.shape)} {like.dtype} tensor on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}.")  # fmt: skip
    return out


def _backward_outputs(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grad_h_is_scratch: bool,
                      out_up: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Where the SwiGLU backward writes ``(d gate, d up)``: ``grad_h`` itself when the caller gives it up and it has
    gate's dtype, else a new tensor; ``out_up`` (checked) or a new tensor."""
    dg = grad_h if grad_h_is_scratch and grad_h.dtype == gate.dtype else torch.empty_like(gate)
    return dg, _out(up, out_up, "out_up")


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
    dg, du = _backward_outputs(grad_h, gate, up, grad_h_is_scratch, out_up)
    if dg.numel():
        tensors = (_rows(grad_h), _rows(gate), _rows(up), _rows(dg), _rows(du))
        _launch(_silu_mul_backward_kernel, tensors, gate.device)
    return dg, du


def _lora_grad_a(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grads: Optional[tuple]) -> torch.Tensor:
    """Launches ``_silu_mul_lora_kernel``: ``t.T @ silu(gate) * up`` in fp32, plus (``grads = (dh, dg, du)``) the
    SwiGLU backward into ``dg`` / ``du``."""
    kernel = _silu_mul_lora_kernel
    require_launchable(kernel, gate.device)
    g2, u2, t2 = _rows(gate), _rows(up), _rows(t)
    if t.dtype != gate.dtype or t2.shape[0] != g2.shape[0]:
        raise ValueError(f"`t` must be a ({g2.shape[0]}, r) {gate.dtype} tensor, got {tuple(t.shape)} {t.dtype}")
    rows, cols = g2.shape
    rank = t2.shape[1]
    splits = max(1, min(MAX_SPLITS, rows // MIN_SPLIT_ROWS))
    rows_per_split = max(1, cdiv(cdiv(rows, splits), LORA_BLOCK_M)) * LORA_BLOCK_M  # not 0: no rows is one split
    splits = max(1, cdiv(rows, rows_per_split))
    ws = torch.empty(splits, rank, cols, dtype=torch.float32, device=gate.device)
    dh, dg, du = (_rows(x) for x in grads) if grads is not None else (g2, g2, g2)  # unread without GRAD_H
    args = (dh, g2, u2, dg, du, t2, ws, rows, cols, rank, rows_per_split, dh.stride(0), g2.stride(0), u2.stride(0),
            dg.stride(0), du.stride(0), t2.stride(0), LORA_BLOCK_M, LORA_BLOCK_N, max(16, next_power_of_2(rank)),
            grads is not None, is_interpreted(kernel))  # fmt: skip
    if rows and cols:
        launch(kernel, (cdiv(cols, LORA_BLOCK_N), splits), args, gate.device, num_warps=LORA_NUM_WARPS)
    else:
        ws.zero_()
    return ws[0] if splits == 1 else ws.sum(0)


def silu_mul_t_matmul(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``t.T @ silu(gate) * up`` as an fp32 ``(r, cols)`` tensor, ``h`` rounded to ``gate.dtype`` as [`silu_mul`]
    rounds it but never written: the down projection's ``dA`` (before the adapter's dtype) from ``t = s g @ B``."""
    return _lora_grad_a(t, gate, up, None)


def silu_mul_backward_lora(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    t: torch.Tensor,
    *,
    grad_h_is_scratch: bool = False,
    out_up: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d gate, d up, t.T @ h)``: [`silu_mul_backward`] and [`silu_mul_t_matmul`] in one pass over gate and up
    (same arguments as [`silu_mul_backward`]; the product in fp32)."""
    dg, du = _backward_outputs(grad_h, gate, up, grad_h_is_scratch, out_up)
    return dg, du, _lora_grad_a(t, gate, up, (grad_h, dg, du))
