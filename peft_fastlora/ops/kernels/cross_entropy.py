"""Cross-entropy over one chunk of logits rows, with its gradient written over the logits: the elementwise half of
the fused linear cross-entropy (``ops/linear_cross_entropy.py``).

For each row ``x`` (``V`` logits) with target ``t`` (``ignore_index``: no loss, zero gradient):

    loss = logsumexp(x) - x[t]
    x   <- grad_scale * (softmax(x) - onehot(t))      (rounded once to the logits dtype)

Math in fp32, like ``reference.cross_entropy_grad_ref`` (the twin, same signature). One program per row reads the
row twice (online max / sum, then the gradient) and keeps nothing but two scalars: the chunk's logits are the only
buffer, so the caller's memory is ``rows x V`` in the logits dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, next_power_of_2, require_launchable

MAX_BLOCK_V = 8192  # logits per loop step of a row (module-level so that tests can make rows span several blocks)
NUM_WARPS = 8


@triton.jit
def _cross_entropy_grad_kernel(
    logits_ptr, stride_row, target_ptr, loss_ptr, V, ignore_index, grad_scale, BLOCK_V: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row).to(tl.int64)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    # Pass 1: running max and sum of exp(x - max) over the row, block by block.
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    # Pass 2: the gradient, over the logits (the target's logit was read above, before it is overwritten).
    scale = tl.where(valid, grad_scale, 0.0)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(offs == safe_target, 1.0, 0.0)
        tl.store(row_ptr + offs, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_(
    logits: torch.Tensor, target: torch.Tensor, grad_scale: float, ignore_index: int
) -> torch.Tensor:
    """Per-row fp32 losses of ``logits`` ``(rows, V)`` (unit stride along V) against ``target`` ``(rows,)``; the
    logits are overwritten with ``grad_scale * (softmax - onehot)`` (rows whose target is ``ignore_index``: zero)."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        kernel = _cross_entropy_grad_kernel
        require_launchable(kernel, logits.device)
        block = min(next_power_of_2(vocab), MAX_BLOCK_V)
        launch(kernel, (rows,), (logits, logits.stride(0), target, loss, vocab, int(ignore_index), float(grad_scale),
                                 block), logits.device, num_warps=NUM_WARPS)  # fmt: skip
    return loss
