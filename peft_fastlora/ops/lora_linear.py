"""QLoRA linear for training: ``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T) @ B.T``.

Shapes (leading dims of ``x`` flattened into M): x, lora_x (M, K); W (N, K); A (r, K); B (N, r); xa = lora_x @ A.T
(M, r); y (M, N).

The base matmul runs on cuBLAS against a W that is dequantized into a fresh tensor from the caching allocator and
dropped as soon as the matmul is queued. W is NOT saved for backward: it is as large as the layer, and backward
dequantizes it again (one memory-bound pass, about a tenth of the matmul at M=2048). What is saved is small or already
alive: the LoRA input (only if A needs a grad), xa (M, r), A, B and the quantized container.

The LoRA matmuls run in the activation dtype: fp32 adapters are cast to it (r-sized tensors; the M-sized activations
are never cast), and their grads are returned in the adapter dtype, accumulated straight into fp32 where cuBLAS can.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dequantize_kernel(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes with the single-launch Triton kernel (interpreted on CPU when ``TRITON_INTERPRET=1``).

    Imported on first use so that ``import peft_fastlora.ops`` works where Triton is absent (CPU-only installs).
    """
    from .dequant import dequantize

    return dequantize(weight, dtype)


@functools.cache
def _cuda_mm_has_out_dtype() -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` (fp16/bf16 in, fp32 out; torch >= 2.8) runs on CUDA."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")
    except RuntimeError:  # older torch: the overload does not exist
        return False


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when it is already ``dtype`` (a no-op ``.to`` still costs host time)."""
    return t if t.dtype == dtype else t.to(dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ b`` returned in ``out_dtype``; fp32 results of fp16/bf16 inputs skip the rounding to 16 bits."""
    if out_dtype != a.dtype and out_dtype == torch.float32 and a.is_cuda and _cuda_mm_has_out_dtype():
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = _as(torch.mm(a, b), out_dtype)
    return out if alpha == 1.0 else out.mul_(alpha)


def check_lora_linear_args(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    lora_x: Optional[torch.Tensor],
) -> None:
    """Raises a clear error for arguments that ``lora_linear_forward`` (and every other path) cannot take."""
    if not isinstance(weight, (Packed4bit, Int8Rowwise)):
        raise TypeError(
            f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}; build one with "
            "`peft_fastlora.bnb_weights.packed4bit_from_bnb` or `int8_from_bnb`."
        )
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"`x` must be float16, bfloat16 or float32, got {x.dtype}; cast the activations first.")
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"`x` must have in_features={k} as its last dim, got shape {tuple(x.shape)}.")
    if weight.device != x.device:
        raise ValueError(f"`weight` is on {weight.device} but `x` is on {x.device}; move the model to one device.")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"`bias` must have shape ({n},), got {tuple(bias.shape)}.")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("`lora_a` and `lora_b` must be given together (or both None for no LoRA term).")
    if lora_a is None:
        return
    r = lora_a.shape[0]
    if lora_a.dim() != 2 or lora_a.shape[1] != k or lora_b.shape != (n, r):
        raise ValueError(
            f"`lora_a` must be (r, {k}) and `lora_b` ({n}, r), got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}."
        )
    if lora_x is not None and lora_x.shape != x.shape:
        raise ValueError(f"`lora_x` must have the shape of `x` {tuple(x.shape)}, got {tuple(lora_x.shape)}.")


def lora_linear_forward(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Computes ``y`` (shape ``(*x.shape[:-1], N)``, dtype ``x.dtype``) and ``xa = lora_x @ A.T`` (M, r) for backward.

    Args: as [`~peft_fastlora.ops.reference.lora_linear_ref`]. ``lora_x=None`` means the LoRA branch reads ``x``.
    """
    check_lora_linear_args(x, weight, bias, lora_a, lora_b, lora_x)
    return _forward(x, weight, bias, lora_a, lora_b, scaling, lora_x)


def _forward(x, weight, bias, lora_a, lora_b, scaling, lora_x):
    """[`lora_linear_forward`] without the checks (the dispatcher ran them; this runs on every training step)."""
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    w = dequantize_kernel(weight, x.dtype)  # (N, K), freed on return; the allocator reuses it stream-ordered
    if bias is None:
        out = torch.mm(x2d, w.t())
    else:
        out = torch.addmm(_as(bias, x.dtype), x2d, w.t())  # bias rides in the cuBLAS epilogue
    del w
    xa = None
    if lora_a is not None:
        lx2d = x2d if lora_x is None else _as(lora_x, x.dtype).reshape(-1, k)
        xa = torch.mm(lx2d, _as(lora_a, x.dtype).t())
        out.addmm_(xa, _as(lora_b, x.dtype).t(), alpha=scaling)  # y += scaling * xa @ B.T, in place
    return out.view(*x.shape[:-1], n), xa


def lora_linear_backward(
    grad_out: torch.Tensor,
    weight: QuantizedWeight,
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_input: Optional[torch.Tensor],
    xa: Optional[torch.Tensor],
    bias_dtype: Optional[torch.dtype],
    needs_grad: tuple[bool, bool, bool, bool, bool],
    separate_lora_x: bool,
    grad_xa: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], ...]:
    """Gradients ``(dx, dlora_x, dA, dB, dbias)`` of [`lora_linear_forward`]; an entry is None when not needed.

    With ``t = scaling * g @ B`` (M, r), computed once: ``dx = g @ W (+ t @ A)``, ``dlora_x = t @ A`` (when the LoRA
    branch has its own input), ``dA = t.T @ lora_x``, ``dB = scaling * g.T @ xa``, ``dbias = g.sum(0)``.

    Args:
        grad_out (`torch.Tensor`): ``dL/dy``, shape ``(*x.shape[:-1], N)``.
        weight: The quantized base weight; dequantized again here, in ``grad_out.dtype``.
        lora_a, lora_b (`torch.Tensor`, *optional*): The adapters (any float dtype; grads come back in it).
        scaling (`float`): LoRA scaling.
        lora_input (`torch.Tensor`, *optional*): The LoRA branch input (``x`` or ``lora_x``); needed for dA only.
        xa (`torch.Tensor`, *optional*): ``lora_input @ A.T`` saved by the forward; needed for dB only.
        bias_dtype (`torch.dtype`, *optional*): dtype of the bias grad.
        needs_grad (`tuple[bool, ...]`): Whether ``(x, lora_x, A, B, bias)`` need a grad; other work is skipped.
        separate_lora_x (`bool`): Whether the LoRA branch read its own ``lora_x`` (else its grad goes into dx).
        grad_xa (`torch.Tensor`, *optional*): Extra ``dL/dxa`` (M, r) when xa is itself an output (custom op).
    """
    need_dx, need_dlx, need_da, need_db, need_dbias = needs_grad
    n, k = weight.shape
    g = grad_out.reshape(-1, n)
    dx = dlx = da = db = dbias = None
    t = a_c = None
    if lora_a is not None:
        a_c = _as(lora_a, g.dtype)
        if need_da or need_dlx or (need_dx and not separate_lora_x):
            b_c = _as(lora_b, g.dtype)
            if grad_xa is None and xa is not None and xa.dtype == g.dtype:
                # scaling in cuBLAS' alpha: one launch instead of mm + mul_ (beta=0: xa only lends its shape)
                t = torch.addmm(xa.reshape(-1, a_c.shape[0]), g, b_c, beta=0, alpha=scaling)
            elif grad_xa is None:
                t = torch.mm(g, b_c).mul_(scaling)
            else:
                t = torch.addmm(_as(grad_xa.reshape(-1, a_c.shape[0]), g.dtype), g, b_c, alpha=scaling)
        if need_db and lora_b.dtype == g.dtype:
            db = torch.addmm(lora_b, g.t(), xa.reshape(-1, a_c.shape[0]), beta=0, alpha=scaling)  # as for t
        elif need_db:
            db = _mm(g.t(), xa.reshape(-1, a_c.shape[0]), lora_b.dtype, alpha=scaling)
        if need_da:
            da = _mm(t.t(), _as(lora_input.reshape(-1, k), g.dtype), lora_a.dtype)
        if need_dlx and separate_lora_x:
            dlx = torch.mm(t, a_c).view(*grad_out.shape[:-1], k)
    if need_dx:
        w = dequantize_kernel(weight, g.dtype)
        dx = torch.mm(g, w)
        del w
        if t is not None and not separate_lora_x:
            dx.addmm_(t, a_c)  # dx += (scaling * g @ B) @ A, in place
        dx = dx.view(*grad_out.shape[:-1], k)
    if need_dbias:
        dbias = g.sum(0, dtype=torch.float32).to(bias_dtype)
    return dx, dlx, da, db, dbias


class LoraLinearFunction(torch.autograd.Function):
    """Autograd wrapper of [`lora_linear_forward`] / [`lora_linear_backward`]; the quantized weight gets no grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, lora_x=None, check=True):
        # check=False: the caller (the dispatcher) validated the arguments already; skips the host time on every call.
        if check:
            check_lora_linear_args(x, weight, bias, lora_a, lora_b, lora_x)
        separate = lora_x is not None and lora_x is not x
        out, xa = _forward(x, weight, bias, lora_a, lora_b, scaling, lora_x if separate else None)
        need_da = lora_a is not None and ctx.needs_input_grad[3]
        lora_input = (lora_x if separate else x) if need_da else None
        ctx.save_for_backward(lora_input, xa, lora_a, lora_b)
        ctx.weight = weight
        ctx.scaling = scaling
        ctx.separate = separate
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lora_input, xa, lora_a, lora_b = ctx.saved_tensors
        nig = ctx.needs_input_grad
        needs = (nig[0], ctx.separate and nig[6], nig[3], nig[4], nig[2])
        dx, dlx, da, db, dbias = lora_linear_backward(
            grad_out, ctx.weight, lora_a, lora_b, ctx.scaling, lora_input, xa, ctx.bias_dtype, needs, ctx.separate
        )
        return dx, None, dbias, da, db, None, dlx, None
