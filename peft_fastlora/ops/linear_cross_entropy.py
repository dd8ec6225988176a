"""The LM head fused with its cross-entropy: ``loss = cross_entropy(hidden @ weight.T + bias, target)`` without the
``tokens x vocab`` logits.

Why: a causal LM's loss upcasts the logits to fp32 (``tokens x vocab x 4`` bytes: 1.25 GB for 2,048 tokens of a
152k vocabulary, plus their bf16 copy and both gradients), usually the largest tensor of a QLoRA step. Here the rows
are taken in chunks: each chunk's logits are made by one matmul, turned into its losses and, in place, into their
gradient (``kernels/cross_entropy.py``), and multiplied back into the hidden states' (and the head's, if it trains)
gradient right away, so backward only scales what forward computed.

Chunk size: a chunk's logits stay under ``chunk_bytes`` (256 MiB by default). Each chunk reads the head's weight
twice (logits, gradient), so chunks much smaller than that re-stream a large head many times: 32 chunks of a
152k x 3584 bf16 head are 70 GB of reads in a step (tens of milliseconds on an H100); 256 MiB chunks read it 3 times
for 2,048 tokens of that model, and once for a 32k vocabulary.

Numerics: the logits are rounded to the compute dtype (as ``nn.Linear`` makes them), the losses and softmax are
fp32, the gradient of the logits is rounded once to the compute dtype. The mean is taken over the targets that are
not ``ignore_index`` (or ``num_items_in_batch``, as transformers' loss does), without a host synchronisation: the
count stays on the device and scales the gradients in backward.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import kernels
from .dispatch import _use_triton, without_autocast
from .reference import cross_entropy_grad_ref

DEFAULT_CHUNK_BYTES = 256 * 2**20


def chunk_rows(vocab: int, element_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: as many as keep a chunk's logits within ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (vocab * element_size))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden (T, H), weight (V, H), bias, target (T,), divisor, ignore_index, rows) -> loss``; gradients are made
    in forward, chunk by chunk, and scaled by ``grad_loss / divisor`` in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, divisor, ignore_index, rows):
        cross_entropy = kernels.load().cross_entropy.cross_entropy_grad_ if _use_triton(hidden.device) else \
            cross_entropy_grad_ref  # fmt: skip
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            end = start + rows
            h = hidden[start:end]
            logits = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
            losses[start:end] = cross_entropy(logits, target[start:end], 1.0, ignore_index)  # logits := their grad
            if grad_hidden is not None:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight += torch.mm(logits.t(), h).float()
            if grad_bias is not None:
                grad_bias += logits.float().sum(0)
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, divisor)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return losses.sum() / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias, divisor = ctx.saved_tensors
        factor = grad_loss.float() / divisor
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(factor.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = (grad_weight * factor).to(ctx.dtypes[0])
        if grad_bias is not None:
            grad_bias = (grad_bias * factor).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against ``target``, a chunk of rows at a time.

    Args:
        hidden (`torch.Tensor`): ``(..., H)`` hidden states (the LM head's input).
        weight (`torch.Tensor`): ``(V, H)``, the LM head's weight.
        target (`torch.Tensor`): Integer targets in ``[0, V)`` or ``ignore_index``, one per row of ``hidden``
            (already shifted for a causal LM). Not checked on the device (that would synchronise with the host).
        bias (`torch.Tensor`, *optional*): ``(V,)``.
        ignore_index (`int`, defaults to -100): Targets with this value add no loss and no gradient.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): Divide the summed loss by this (transformers'
            gradient-accumulation convention) instead of taking the mean over the targets that count.
        chunk_bytes (`int`, defaults to 256 MiB): Upper bound on one chunk's logits.

    Returns:
        `torch.Tensor`: The fp32 scalar loss.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"`weight` must be (vocab, {hidden.shape[-1]}) for `hidden` of shape {tuple(hidden.shape)}, "
                         f"got {tuple(weight.shape)}.")  # fmt: skip
    if target.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"`target` must hold one target per row of `hidden` ({hidden.numel() // hidden.shape[-1]}), "
                         f"got {target.numel()}.")  # fmt: skip
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"`target` must be an integer tensor, got {target.dtype}.")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"`chunk_bytes` must be a positive int, got {chunk_bytes!r}.")
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(dtype).contiguous()
    target = target.reshape(-1).to(hidden.device)
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    if num_items_in_batch is None:
        divisor = (target != ignore_index).sum().float()
    else:
        divisor = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device).reshape(())
    if torch.compiler.is_compiling():  # a Python loop of launches: under torch.compile, the plain (unfused) math
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum") / divisor
    rows = chunk_rows(weight.shape[0], hidden.element_size(), chunk_bytes)
    args = (hidden, weight, bias, target, divisor, int(ignore_index), rows)
    if not autocast:
        return LinearCrossEntropyFunction.apply(*args)
    return without_autocast(device_type, LinearCrossEntropyFunction.apply, *args)
