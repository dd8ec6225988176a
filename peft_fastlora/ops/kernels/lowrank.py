"""Triton low-rank update in place, ``out += scaling * a @ b.T``: LoRA's term added into the base matmul's output
(``a = xa``, ``b = B``) and into the input grad (``a = t``, ``b = A.T``).

Why not cuBLAS: with ``a`` and ``b`` only r = 8..64 wide the update is a memory-bound pass over ``out`` (read once,
written once), and cuBLAS' ``addmm_`` with ``beta=1`` moved it at 1.8-1.9 TB/s on an H100 against 2.9 TB/s for a copy
of the same size (M = 8,192, N = 4,096 / 14,336: 73.8 / 248.8 us); this kernel, one (64 x 128) tile of ``out`` per
program with the whole rank in one ``tl.dot``, ran at the copy's speed (51.4 / 163.0 us). Math: fp32 products and
sum, ``out + scaling * acc`` in fp32, one rounding to ``out.dtype`` (as ``addmm_``).

Kernel -> launcher (checks the layout it relies on, launches); twin: ``reference.lowrank_add_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jit import round_to
from .launch import cdiv, is_interpreted, launch, next_power_of_2, require_launchable

BLOCK_M = 64
BLOCK_N = 128
NUM_WARPS = 4
MAX_RANK = 64  # the rank rides in one tl.dot; past this the tile no longer fits the registers it was tuned for


@triton.jit
def _lowrank_add_kernel(out_ptr, a_ptr, b_ptr, rows, cols, rank, scaling, out_stride, a_stride, b_stride_n,
                        b_stride_r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        INTERPRET: tl.constexpr):  # fmt: skip
    # one (BLOCK_M, BLOCK_N) tile of out per program, tiles of one row block adjacent (they share a's rows)
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(cols, BLOCK_N)
    offs_m = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    in_m, in_n, in_r = offs_m < rows, offs_n < cols, offs_r < rank
    a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * a_stride + offs_r[None, :],
                mask=in_m[:, None] & in_r[None, :], other=0.0)  # fmt: skip
    b = tl.load(b_ptr + offs_n[None, :] * b_stride_n + offs_r[:, None] * b_stride_r,
                mask=in_n[None, :] & in_r[:, None], other=0.0)  # fmt: skip
    if INTERPRET:  # the interpreter's 16-bit tl.dot is wrong; fp32 holds 16-bit products exactly
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    acc = tl.dot(a, b)
    mask = in_m[:, None] & in_n[None, :]
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + scaling * acc
    tl.store(ptrs, round_to(y, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def supports(out: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether [`lowrank_add_`] takes these: a 16-bit 2-D ``out`` with unit column stride, ``a`` of its dtype with
    unit column stride and rank <= ``MAX_RANK``."""
    return (
        out.dtype in (torch.float16, torch.bfloat16)
        and out.dim() == 2
        and a.dtype == out.dtype
        and a.shape[1] <= MAX_RANK
        and (out.stride(1) == 1 or out.shape[1] == 1)
        and (a.stride(1) == 1 or a.shape[1] == 1)
    )


def lowrank_add_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``out += scaling * a @ b.T`` in place and returns ``out``.

    Args:
        out (`torch.Tensor`): (M, N), fp16 or bf16, unit column stride (rows may be further apart).
        a (`torch.Tensor`): (M, r) in ``out.dtype``, unit column stride, ``r <= MAX_RANK``.
        b (`torch.Tensor`): (N, r) in ``out.dtype``, any strides (``A.T`` of an (r, N) ``A`` is a view).
        scaling (`float`): The factor on the product.
    """
    shapes_match = a.shape[0] == out.shape[0] and b.shape == (out.shape[1], a.shape[1])
    if not supports(out, a) or b.dtype != out.dtype or not shapes_match:
        raise ValueError(
            f"lowrank_add_ needs out (M, N) and a (M, r) of one 16-bit dtype with unit column strides, r <= "
            f"{MAX_RANK}, and b (N, r) of that dtype; got out {tuple(out.shape)} {out.dtype} strides {out.stride()}, "
            f"a {tuple(a.shape)} {a.dtype} strides {a.stride()}, b {tuple(b.shape)} {b.dtype}"
        )
    return launch_lowrank_add_(out, a, b, scaling)


def launch_lowrank_add_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """[`lowrank_add_`] without its checks, for a caller whose operands [`supports`] took and whose shapes and
    dtypes match by construction (the training path, once per layer call)."""
    rows, cols = out.shape
    rank = a.shape[1]
    if rows == 0 or cols == 0:
        return out
    kernel = _lowrank_add_kernel
    require_launchable(kernel, out.device)
    grid = (cdiv(rows, BLOCK_M) * cdiv(cols, BLOCK_N),)
    args = (out, a, b, rows, cols, rank, float(scaling), out.stride(0), a.stride(0), b.stride(0), b.stride(1),
            BLOCK_M, BLOCK_N, max(16, next_power_of_2(rank)), is_interpreted(kernel))  # fmt: skip
    launch(kernel, grid, args, out.device, num_warps=NUM_WARPS)
    return out
