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

Pending low-rank terms: ``gate_term`` / ``up_term`` / ``grad_h_term = (a, b, scaling)`` say that the operand the math
sees is ``operand + scaling * a @ b.T`` (LoRA's term: ``a`` (rows, r), ``b`` (cols, r), r <= ``lowrank.MAX_RANK``),
rounded once to its dtype exactly as ``lowrank.lowrank_add_`` would leave it in memory, but made in registers (one
``tl.dot`` per tile, fp32 products and sum) and never written; ``t.T @ h`` uses h as [`silu_mul`] with those terms
writes it. The kernels read gate, up and d h anyway, while a ``lowrank_add_`` pass over each was one more read and
write of the whole matrix (224 MiB each at 8,192 tokens x 14,336). Without terms, the kernels and tiles are as above.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .jit import round_to
from .launch import cdiv, is_interpreted, launch, next_power_of_2, require_launchable
from .lowrank import MAX_RANK

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
# With pending terms (H100, bf16, 8,192 x 14,336, t of rank 16, terms of rank 8 / 16 / 64, in us). silu_mul:
# (TERMS_BLOCK_M x TERMS_BLOCK_N) tiles, each term's whole rank in one tl.dot as in lowrank.py; 64x64 with 8 warps
# 295 / 300 / 380 against 571 / 573 / 587 for two lowrank_add_ and silu_mul (in a probe of tiles, 64x128 with 4 warps
# took 8 % longer at r = 16, 32x64 with 4 warps 4-8 % less at r <= 16 but 22 % more at r = 64). The t.T @ h kernel
# with three terms, three more tl.dots a tile: 32x64 tiles, 4 warps, 8 splits 492 / 497 / 587 against 692 / 695 / 704
# for lowrank_add_ of dh and the kernel without terms (its own 32x128 tiles, 8 warps, 2 splits took about 760 at
# r = 16 with terms; 16x64 won at some ranks and lost at others). 8 splits hold 8 x r x cols fp32 partial sums
# (7.3 MB at r = 16).
TERMS_BLOCK_M = 64
TERMS_BLOCK_N = 64
TERMS_NUM_WARPS = 8
LORA_TERMS_BLOCK_M = 32
LORA_TERMS_BLOCK_N = 64
LORA_TERMS_NUM_WARPS = 4
LORA_TERMS_MAX_SPLITS = 8
TERM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
def _term_b(b_ptr, offs_n, in_n, rank, b_stride_n, b_stride_r, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr):
    # (BLOCK_R, BLOCK_N) of b.T, b (cols, rank * ALIGN) of any strides; ranks past it are 0 (the pad adds nothing)
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + offs_n[None, :] * b_stride_n + offs_r[:, None] * b_stride_r,
                   mask=in_n[None, :] & (offs_r < rank * ALIGN)[:, None], other=0.0)  # fmt: skip


@triton.jit
def _term_a(a_ptr, offs_m, in_m, rank, a_stride, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr):
    # (BLOCK_M, BLOCK_R) of a term's a. Rank and a's row stride come divided by ALIGN (up to 8, both multiples of
    # it): the compiler then knows a's rows are aligned and whole vectors in or out of the mask, and loads them as
    # vectors (H100, r = 8, a's rows 8 apart: the t.T @ h kernel with three terms took 592 us at 8,192 x 14,336
    # without this, 460 with it)
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * (a_stride * ALIGN) + offs_r[None, :],
                   mask=in_m[:, None] & (offs_r < rank * ALIGN)[None, :], other=0.0)  # fmt: skip


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    # acc + a @ b with fp32 products and sum: 16-bit operands on tensor cores, fp32 ones in fp32 (as torch.mm, not
    # TF32); the interpreter's 16-bit tl.dot is wrong, and fp32 holds 16-bit products exactly
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _plus_term(x, a, b, scaling, INTERPRET: tl.constexpr):
    # the fp32 tile x of an operand with its pending term: x + scaling * a @ b (a from _term_a, b from _term_b; fp32
    # products and sum), rounded once to the operand's dtype (a's) as lowrank_add_ would store it, read back as fp32
    acc = _dot(a, b, tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32), INTERPRET)
    return round_to(x + scaling * acc, a.dtype, INTERPRET).to(tl.float32)


@triton.jit
def _silu_mul_terms_kernel(g_ptr, u_ptr, h_ptr, rows, cols, g_stride, u_stride, h_stride,
                           ga_ptr, gb_ptr, g_rank, g_scaling, ga_stride, gb_stride_n, gb_stride_r,
                           ua_ptr, ub_ptr, u_rank, u_scaling, ua_stride, ub_stride_n, ub_stride_r,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATE_TERM: tl.constexpr,
                           BLOCK_RG: tl.constexpr, G_ALIGN: tl.constexpr, UP_TERM: tl.constexpr,
                           BLOCK_RU: tl.constexpr, U_ALIGN: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    # [`_silu_mul_kernel`] on (BLOCK_M, BLOCK_N) tiles, gate and/or up with their terms; tiles of one row block
    # adjacent (they share the rows of the terms' a)
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(cols, BLOCK_N)
    offs_m = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < rows, offs_n < cols
    row = offs_m.to(tl.int64)[:, None]
    mask = in_m[:, None] & in_n[None, :]
    g = tl.load(g_ptr + row * g_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE_TERM:
        gb = _term_b(gb_ptr, offs_n, in_n, g_rank, gb_stride_n, gb_stride_r, BLOCK_RG, G_ALIGN)
        ga = _term_a(ga_ptr, offs_m, in_m, g_rank, ga_stride, BLOCK_RG, G_ALIGN)
        g = _plus_term(g, ga, gb, g_scaling, INTERPRET)
    u = tl.load(u_ptr + row * u_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if UP_TERM:
        ub = _term_b(ub_ptr, offs_n, in_n, u_rank, ub_stride_n, ub_stride_r, BLOCK_RU, U_ALIGN)
        ua = _term_a(ua_ptr, offs_m, in_m, u_rank, ua_stride, BLOCK_RU, U_ALIGN)
        u = _plus_term(u, ua, ub, u_scaling, INTERPRET)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * h_stride + offs_n[None, :], round_to(h, h_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _silu_mul_lora_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, t_ptr, ws_ptr, gws_ptr, uws_ptr, rows, cols, rank,
                          rows_per_split, dh_stride, g_stride, u_stride, dg_stride, du_stride, t_stride,
                          ga_ptr, gb_ptr, g_rank, g_scaling, ga_stride, gb_stride_n, gb_stride_r,
                          ua_ptr, ub_ptr, u_rank, u_scaling, ua_stride, ub_stride_n, ub_stride_r,
                          da_ptr, db_ptr, d_rank, d_scaling, da_stride, db_stride_n, db_stride_r,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GRAD_H: tl.constexpr,
                          GATE_TERM: tl.constexpr, BLOCK_RG: tl.constexpr, G_ALIGN: tl.constexpr,
                          UP_TERM: tl.constexpr, BLOCK_RU: tl.constexpr, U_ALIGN: tl.constexpr,
                          GRAD_H_TERM: tl.constexpr, BLOCK_RD: tl.constexpr, D_ALIGN: tl.constexpr,
                          TERM_B_GRADS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    # grid (column blocks, row splits). ws[split, :rank, cols] = t[rows of split].T @ h[rows of split]; with GRAD_H
    # also d gate / d up of those rows (d gate may be written over dh: each element is read before it is written).
    # *_TERM: that operand with its pending term (see _plus_term); b's tile is the same for all of a program's rows.
    # TERM_B_GRADS (GRAD_H with both operand terms): also gws[split] = a_gate.T @ d gate and uws[split] = a_up.T @
    # d up over the split's rows, d gate / d up as stored: the terms' B grads, transposed and unscaled.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    in_n, in_r = offs_n < cols, offs_r < rank
    if GATE_TERM:
        gb = _term_b(gb_ptr, offs_n, in_n, g_rank, gb_stride_n, gb_stride_r, BLOCK_RG, G_ALIGN)
    if UP_TERM:
        ub = _term_b(ub_ptr, offs_n, in_n, u_rank, ub_stride_n, ub_stride_r, BLOCK_RU, U_ALIGN)
    if GRAD_H_TERM:
        db = _term_b(db_ptr, offs_n, in_n, d_rank, db_stride_n, db_stride_r, BLOCK_RD, D_ALIGN)
    row_begin = split * rows_per_split
    row_end = tl.minimum(row_begin + rows_per_split, rows)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    if TERM_B_GRADS:
        acc_gb = tl.zeros((BLOCK_RG, BLOCK_N), dtype=tl.float32)
        acc_ub = tl.zeros((BLOCK_RU, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_begin, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < row_end
        row = offs_m.to(tl.int64)[:, None]
        mask = in_m[:, None] & in_n[None, :]
        g = tl.load(g_ptr + row * g_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATE_TERM:
            ga = _term_a(ga_ptr, offs_m, in_m, g_rank, ga_stride, BLOCK_RG, G_ALIGN)
            g = _plus_term(g, ga, gb, g_scaling, INTERPRET)
        if UP_TERM:
            ua = _term_a(ua_ptr, offs_m, in_m, u_rank, ua_stride, BLOCK_RU, U_ALIGN)
            u = _plus_term(u, ua, ub, u_scaling, INTERPRET)
        sig = tl.sigmoid(g)
        silu = g * sig
        h = round_to(silu * u, g_ptr.dtype.element_ty, INTERPRET)  # h as silu_mul writes it
        if GRAD_H:
            dh = tl.load(dh_ptr + row * dh_stride + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            if GRAD_H_TERM:
                dha = _term_a(da_ptr, offs_m, in_m, d_rank, da_stride, BLOCK_RD, D_ALIGN)
                dh = _plus_term(dh, dha, db, d_scaling, INTERPRET)
            dg = round_to(dh * u * sig * (1.0 + g * (1.0 - sig)), dg_ptr.dtype.element_ty, INTERPRET)
            du = round_to(dh * silu, du_ptr.dtype.element_ty, INTERPRET)
            tl.store(dg_ptr + row * dg_stride + offs_n[None, :], dg, mask=mask)
            tl.store(du_ptr + row * du_stride + offs_n[None, :], du, mask=mask)
            if TERM_B_GRADS:  # masked rows and columns hold 0 in a and in the grads
                acc_gb = _dot(tl.trans(ga), dg, acc_gb, INTERPRET)
                acc_ub = _dot(tl.trans(ua), du, acc_ub, INTERPRET)
        t = tl.load(t_ptr + offs_m.to(tl.int64)[None, :] * t_stride + offs_r[:, None],
                    mask=in_r[:, None] & in_m[None, :], other=0.0)  # fmt: skip
        acc = _dot(t, h, acc, INTERPRET)
    ws = ws_ptr + split.to(tl.int64) * rank * cols + offs_r[:, None] * cols + offs_n[None, :]
    tl.store(ws, acc, mask=in_r[:, None] & in_n[None, :])
    if TERM_B_GRADS:
        _store_split(gws_ptr, acc_gb, split, g_rank * G_ALIGN, cols, offs_n, in_n, BLOCK_RG)
        _store_split(uws_ptr, acc_ub, split, u_rank * U_ALIGN, cols, offs_n, in_n, BLOCK_RU)


@triton.jit
def _store_split(ws_ptr, acc, split, rank, cols, offs_n, in_n, BLOCK_R: tl.constexpr):
    # a split's (rank, BLOCK_N) partial sums into ws (splits, rank, cols)
    offs_r = tl.arange(0, BLOCK_R)
    ws = ws_ptr + split.to(tl.int64) * rank * cols + offs_r[:, None] * cols + offs_n[None, :]
    tl.store(ws, acc, mask=(offs_r < rank)[:, None] & in_n[None, :])


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


def _term(term: Optional[tuple], like: torch.Tensor, name: str) -> Optional[tuple]:
    """The pending term ``(a, b, scaling)`` of the 2-D operand ``like`` (or None), checked."""
    if term is None:
        return None
    a, b, _ = term
    rows, cols = like.shape
    r = a.shape[1] if a.dim() == 2 else 0
    if not (like.dtype in TERM_DTYPES and a.dtype == b.dtype == like.dtype and a.device == b.device == like.device
            and a.dim() == 2 and a.shape[0] == rows and tuple(b.shape) == (cols, r) and 1 <= r <= MAX_RANK
            and (a.stride(1) == 1 or r == 1)):  # fmt: skip
        raise ValueError(
            f"`{name}` must be (a, b, scaling) with a ({rows}, r) and b ({cols}, r) of the operand's dtype "
            f"{like.dtype} (fp16, bf16 or fp32) and device, 1 <= r <= {MAX_RANK}, a of unit column stride; got a "
            f"{tuple(a.shape)} {a.dtype} strides {a.stride()}, b {tuple(b.shape)} {b.dtype} on {b.device}"
        )
    return term


def _term_args(term: Optional[tuple], like: torch.Tensor) -> tuple[tuple, tuple]:
    """A checked term's kernel arguments ``(a, b, rank / align, scaling, a's row stride / align, b's strides)`` and
    constexprs ``(flag, rank padded for tl.dot, align)``; without a term, placeholders the kernel never reads."""
    if term is None:
        return (like, like, 0, 0.0, 0, 0, 0), (False, 16, 1)
    a, b, scaling = term
    r = a.shape[1]
    align = math.gcd(a.stride(0), r, 8)  # see _plus_term
    args = (a, b, r // align, float(scaling), a.stride(0) // align, b.stride(0), b.stride(1))
    return args, (True, max(16, next_power_of_2(r)), align)


def _backward_outputs(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grad_h_is_scratch: bool,
                      out_up: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Where the SwiGLU backward writes ``(d gate, d up)``: ``grad_h`` itself when the caller gives it up and it has
    gate's dtype, else a new tensor; ``out_up`` (checked) or a new tensor."""
    dg = grad_h if grad_h_is_scratch and grad_h.dtype == gate.dtype else torch.empty_like(gate)
    return dg, _out(up, out_up, "out_up")


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None, *,
             gate_term: Optional[tuple] = None, up_term: Optional[tuple] = None) -> torch.Tensor:  # fmt: skip
    """``silu(gate) * up`` in ``gate.dtype`` (fp32 math, one rounding), into ``out`` when given (a tensor like
    ``gate``, whose rows may be further apart: the first columns of a wider matrix). ``gate_term`` / ``up_term``:
    ``(a, b, scaling)``, the operand's pending ``scaling * a @ b.T``, added in registers (module docstring)."""
    h = _out(gate, out, "out")
    if gate_term is None and up_term is None:
        if h.numel():
            _launch(_silu_mul_kernel, (_rows(gate), _rows(up), _rows(h)), gate.device)
        return h
    g2, u2, h2 = _rows(gate), _rows(up), _rows(h)
    g_args, g_flags = _term_args(_term(gate_term, g2, "gate_term"), g2)
    u_args, u_flags = _term_args(_term(up_term, u2, "up_term"), u2)
    if h.numel():
        kernel = _silu_mul_terms_kernel
        require_launchable(kernel, gate.device)
        rows, cols = g2.shape
        args = (g2, u2, h2, rows, cols, g2.stride(0), u2.stride(0), h2.stride(0), *g_args, *u_args, TERMS_BLOCK_M,
                TERMS_BLOCK_N, *g_flags, *u_flags, is_interpreted(kernel))  # fmt: skip
        grid = (cdiv(rows, TERMS_BLOCK_M) * cdiv(cols, TERMS_BLOCK_N),)
        launch(kernel, grid, args, gate.device, num_warps=TERMS_NUM_WARPS)
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


def _lora_grad_a(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grads: Optional[tuple],
                 terms: tuple = (None, None, None), term_b_grads: bool = False) -> tuple:  # fmt: skip
    """Launches ``_silu_mul_lora_kernel``: ``(t.T @ silu(gate) * up, ...)`` in fp32, plus (``grads = (dh, dg, du)``)
    the SwiGLU backward into ``dg`` / ``du``; ``terms``: those of gate, up and dh (unchecked: [`_term`] checks them);
    ``term_b_grads`` (with grads and the gate and up terms): also ``a_gate.T @ dg`` and ``a_up.T @ du`` in fp32."""
    kernel = _silu_mul_lora_kernel
    require_launchable(kernel, gate.device)
    g2, u2, t2 = _rows(gate), _rows(up), _rows(t)
    if t.dtype != gate.dtype or t2.shape[0] != g2.shape[0]:
        raise ValueError(f"`t` must be a ({g2.shape[0]}, r) {gate.dtype} tensor, got {tuple(t.shape)} {t.dtype}")
    if term_b_grads and (grads is None or terms[0] is None or terms[1] is None):
        raise ValueError("`term_b_grads=True` needs the gate and up grads and both `gate_term` and `up_term`.")
    rows, cols = g2.shape
    rank = t2.shape[1]
    block_m, block_n, warps, max_splits = (
        (LORA_BLOCK_M, LORA_BLOCK_N, LORA_NUM_WARPS, MAX_SPLITS) if all(term is None for term in terms)
        else (LORA_TERMS_BLOCK_M, LORA_TERMS_BLOCK_N, LORA_TERMS_NUM_WARPS, LORA_TERMS_MAX_SPLITS)
    )  # fmt: skip
    splits = max(1, min(max_splits, rows // MIN_SPLIT_ROWS))
    rows_per_split = max(1, cdiv(cdiv(rows, splits), block_m)) * block_m  # not 0: no rows is one split
    splits = max(1, cdiv(rows, rows_per_split))
    dh, dg, du = (_rows(x) for x in grads) if grads is not None else (g2, g2, g2)  # unread without GRAD_H
    (g_args, g_flags), (u_args, u_flags), (d_args, d_flags) = (
        _term_args(_term(term, like, name), like)
        for term, like, name in zip(terms, (g2, u2, dh), ("gate_term", "up_term", "grad_h_term"))
    )
    workspaces = [torch.empty(splits, r, cols, dtype=torch.float32, device=gate.device)
                  for r in [rank] + ([terms[0][0].shape[1], terms[1][0].shape[1]] if term_b_grads else [])]  # fmt: skip
    ws = workspaces[0]
    gws, uws = workspaces[1:] if term_b_grads else (ws, ws)  # unwritten without TERM_B_GRADS
    args = (dh, g2, u2, dg, du, t2, ws, gws, uws, rows, cols, rank, rows_per_split, dh.stride(0), g2.stride(0),
            u2.stride(0), dg.stride(0), du.stride(0), t2.stride(0), *g_args, *u_args, *d_args, block_m, block_n,
            max(16, next_power_of_2(rank)), grads is not None, *g_flags, *u_flags, *d_flags, term_b_grads,
            is_interpreted(kernel))  # fmt: skip
    if rows and cols:
        launch(kernel, (cdiv(cols, block_n), splits), args, gate.device, num_warps=warps)
    else:
        for w in workspaces:
            w.zero_()
    # the splits' partial sums added in a fixed order: the same result every run
    return tuple(w[0] if splits == 1 else w.sum(0) for w in workspaces)


def silu_mul_t_matmul(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, gate_term: Optional[tuple] = None,
                      up_term: Optional[tuple] = None) -> torch.Tensor:  # fmt: skip
    """``t.T @ silu(gate) * up`` as an fp32 ``(r, cols)`` tensor, ``h`` rounded to ``gate.dtype`` as [`silu_mul`]
    rounds it but never written: the down projection's ``dA`` (before the adapter's dtype) from ``t = s g @ B``.
    ``gate_term`` / ``up_term`` as in [`silu_mul`]."""
    return _lora_grad_a(t, gate, up, None, (gate_term, up_term, None))[0]


def silu_mul_backward_lora(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    t: torch.Tensor,
    *,
    grad_h_is_scratch: bool = False,
    out_up: Optional[torch.Tensor] = None,
    gate_term: Optional[tuple] = None,
    up_term: Optional[tuple] = None,
    grad_h_term: Optional[tuple] = None,
    term_b_grads: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(d gate, d up, t.T @ h)``: [`silu_mul_backward`] and [`silu_mul_t_matmul`] in one pass over gate and up
    (same arguments as [`silu_mul_backward`]; the product in fp32). ``gate_term`` / ``up_term`` / ``grad_h_term``:
    ``(a, b, scaling)``, the operand's pending ``scaling * a @ b.T`` (module docstring); grad_h's memory is only
    written as d gate, with ``grad_h_is_scratch``.

    ``term_b_grads`` (needs ``gate_term`` and ``up_term``): two more outputs, ``a_gate.T @ d gate`` and ``a_up.T @
    d up`` in fp32 (d gate and d up as returned), the gate and up terms' B grads transposed and before their scaling,
    summed in the same pass instead of a later read of d gate and d up."""
    dg, du = _backward_outputs(grad_h, gate, up, grad_h_is_scratch, out_up)
    products = _lora_grad_a(t, gate, up, (grad_h, dg, du), (gate_term, up_term, grad_h_term), term_b_grads)
    return dg, du, *products
