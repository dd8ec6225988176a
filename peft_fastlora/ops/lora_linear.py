"""QLoRA linear for training: ``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T) @ B.T``.

Shapes (leading dims of ``x`` flattened into M): x, lora_x (M, K); W (N, K); A (r, K); B (N, r); xa = lora_x @ A.T
(M, r); y (M, N).

The base matmul runs on cuBLAS against a W that is dequantized into a fresh tensor from the caching allocator and
dropped as soon as the matmul is queued (in the fast path's fused ops, in windows when W is larger than the activation:
[`weight_windows`], [`PLAIN_LAYER_WINDOWS`]). W is NOT saved for backward: it is as large as the layer, and backward
dequantizes it again (one memory-bound pass, about a tenth of the matmul at M=2048). What is saved is small or already
alive: the LoRA input (only if A needs a grad), xa (M, r), A, B and the quantized container.

The LoRA matmuls run in the activation dtype: fp32 adapters are cast to it (r-sized tensors; the M-sized activations
are never cast), and their grads are returned in the adapter dtype, accumulated straight into fp32 where cuBLAS can.
The low-rank term is added in place into the output (forward) and into ``dx`` (backward) by one Triton pass
([`add_low_rank_`]): those are memory-bound passes over M x N, where cuBLAS' ``addmm_`` reaches ~65 % of a copy's rate.

Argument order. [`LoraLinearFunction`] and the ``peft_fastlora::lora_linear`` custom op take the same arguments in
the same order, ``(x, bias, lora_a, lora_b, scaling, lora_x, <weight>)``: the weight comes last because the custom
op takes it as its three fields (``weight.to_fields()``). Both wrappers save and differentiate through
[`save_for_backward`] and [`needed_grads`]. Arguments are checked at the door (``dispatch.fastlora_linear``);
``lora_x=None`` means the LoRA branch reads ``x``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple, Optional

import torch

from . import kernels
from .quant_state import QuantizedWeight

# Inputs before the weight, in both wrappers' order; the ones with a gradient are (x, bias, lora_a, lora_b, lora_x).
X, BIAS, LORA_A, LORA_B, SCALING, LORA_X = range(6)

# Each matmul with the base weight needs W dequantized. Where W is larger than the activation it multiplies (few
# tokens, as at batch 1 with checkpointing, where these copies set the step's peak) it is made in windows, one matmul
# per window writing its part of the result: forward cuts W's rows (y's columns), backward's ``dx = g @ W`` its
# columns (dx's columns). A window is at most half the activation, but not under MIN_WINDOW_BYTES (the small
# attention weights stay whole), at least MIN_WINDOW wide (narrower matmuls fill too few of the GPU's tiles), and
# there are at most MAX_WINDOWS (past a few, the launches cost more than the memory is worth).
MIN_WINDOW_BYTES = 32 << 20
MIN_WINDOW = 1024
MAX_WINDOWS = 4
ROW_WINDOW_ALIGN = 64  # forward windows start on a multiple of 64 rows (whole matmul tiles)
# A plain FastLoRA layer makes W whole. Its step's peak is elsewhere (the loss's fp32 logits: 2.421 GiB at batch 1
# with checkpointing on the benchmark model, with windows or without), while every window is one more dequant launch
# and cuBLAS call of host time, which is what a batch-1 step waits on (an MLP projection's forward + backward at 2,048
# tokens: 1.95-1.99 ms of host time in 4 windows, 1.22-1.68 ms whole, H100 host). The fast path's fused ops
# (projection groups, the fused MLP), whose step has no logits peak, take windows where gradient checkpointing puts
# the peak ([`fused_op_windows`]).
PLAIN_LAYER_WINDOWS = 1


class Windows(NamedTuple):
    """The most windows a fused op cuts W into in its forward and in its backward ([`fused_op_windows`])."""

    forward: int
    backward: int


WHOLE = Windows(1, 1)
# True while a decoder block that gradient checkpointing keeps rather than recomputes runs its forward (the fast path
# keeps the last one): its backward peaks as a recomputed block's does, but no saved-tensor hooks say so.
_KEPT_BLOCK: contextvars.ContextVar[bool] = contextvars.ContextVar("peft_fastlora_kept_block", default=False)


@contextlib.contextmanager
def kept_under_checkpointing():
    """Marks the forward of a block that gradient checkpointing keeps (does not recompute): the fused ops in it take
    windows as in a checkpointed block ([`fused_op_windows`])."""
    token = _KEPT_BLOCK.set(True)
    try:
        yield
    finally:
        _KEPT_BLOCK.reset(token)


def fused_op_windows() -> Windows:
    """The windows of a fused op (projection groups, the fused MLP) called now; its autograd context keeps
    ``backward`` for its backward pass.

    Windows lower the step's peak only under gradient checkpointing, where it sits inside the backward pass: in the
    fused MLP's backward, or in the forward that checkpointing recomputes there (1.972 -> 1.902 GiB at batch 1 on the
    benchmark model). Without checkpointing the windows lowered no peak (H100: 3.405 GiB at batch 1 and 8.750 at
    batch 4 with and without) and cost time: host time per launch, and GPU time too, smaller matmuls and more
    dequant launches (the recorded batch-1 step without checkpointing, H200: 35.2 ms in windows, 33.3-33.7 whole). So an
    op takes windows only in a checkpointed forward: one under saved-tensor hooks (non-reentrant checkpointing, and the
    activation offload inside it), inside a backward pass (a recompute, either kind) or in a block that checkpointing
    keeps ([`kept_under_checkpointing`]: the kept block's backward held 10 MB more whole). There its backward takes
    ``MAX_WINDOWS``, and so does its forward when that is the recompute or is being recorded into a CUDA graph; an
    eager first forward makes W whole: its windows lowered the peak by 10 MB (batch 1, 1.944 against 1.954 GiB) for
    1.10x the host time of the step, while a recording pays no host time and keeps the recorded step's peak (1.964
    GiB, against Unsloth's 1.978).
    """
    in_backward = torch._C._current_graph_task_id() != -1  # (torch.utils.checkpoint asks the same)
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not in_backward and hooks is None and not _KEPT_BLOCK.get():
        return WHOLE
    recording = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()  # (a CPU-only torch raises)
    return Windows(MAX_WINDOWS if in_backward or recording else 1, MAX_WINDOWS)


@functools.cache
def _cuda_mm_has_out_dtype() -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` (fp16/bf16 in, fp32 out; torch >= 2.8) runs on CUDA."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")
    except RuntimeError:  # older torch: the overload does not exist
        return False


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when it is already ``dtype`` (a no-op ``.to`` still costs host time)."""
    return t if t.dtype == dtype else t.to(dtype)


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * a @ b`` returned in ``out_dtype``; fp32 results of fp16/bf16 inputs skip the rounding to 16 bits."""
    if out_dtype != a.dtype and out_dtype == torch.float32 and a.is_cuda and _cuda_mm_has_out_dtype():
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = _cast(torch.mm(a, b), out_dtype)
    return out if alpha == 1.0 else out.mul_(alpha)


def lora_b_grad(g: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """``dB = scaling * g.T @ xa`` in ``lora_b``'s dtype, the scaling in cuBLAS' alpha (with ``beta=0``, ``lora_b``
    only lends its shape and dtype to ``addmm``); fp32 adapters of 16-bit activations get fp32 straight from cuBLAS
    where it can."""
    if lora_b.dtype == g.dtype:
        return torch.addmm(lora_b, g.t(), xa, beta=0, alpha=scaling)
    return _matmul(g.t(), xa, lora_b.dtype, alpha=scaling)


def weight_windows(m: int, n: int, k: int, length: int, align: int, element_size: int,
                   max_windows: int = MAX_WINDOWS) -> list[tuple[int, int]]:  # fmt: skip
    """Windows ``[(start, stop), ...]`` covering ``[0, length)`` (``n``: rows, ``k``: columns) of a weight ``(n, k)``
    dequantized to ``element_size`` bytes and multiplied by an ``(m, k)`` activation: each window at most half the
    activation's size but not under ``MIN_WINDOW_BYTES``, at most ``length // MIN_WINDOW`` and ``max_windows`` of
    them, each a multiple of ``align`` wide (``align == 0``: the weight takes no windows, one window)."""
    window = max(m * k // 2, MIN_WINDOW_BYTES // element_size, 1)
    count = min(-(-(n * k) // window), length // MIN_WINDOW, max_windows)
    if count <= 1 or not align:
        return [(0, length)]
    width = -(-length // count)
    width = -(-width // align) * align
    return [(start, min(start + width, length)) for start in range(0, length, width)]


def _base_matmul(x2d: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor],
                 max_windows: int = 1, out: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """``x2d @ dequant(W).T (+ bias)`` (M, N) in ``x2d.dtype``, W made whole or in up to ``max_windows`` row
    windows; into ``out`` (a contiguous (M, N) tensor of that dtype) when given."""
    dequant = kernels.load().dequant
    n, k = weight.shape
    bias = None if bias is None else _cast(bias, x2d.dtype)
    align = ROW_WINDOW_ALIGN if dequant.column_alignment(weight) else 0
    windows = weight_windows(x2d.shape[0], n, k, n, align, x2d.element_size(), max_windows)
    if len(windows) == 1:
        w = dequant.dequantize_triton(weight, x2d.dtype)  # freed on return (the allocator reuses it)
        if bias is None:
            return torch.mm(x2d, w.t(), out=out)  # out=None: a new tensor
        return torch.addmm(bias, x2d, w.t(), out=out)  # bias in cuBLAS' epilogue
    if out is None:
        out = torch.empty(x2d.shape[0], n, dtype=x2d.dtype, device=x2d.device)
    for start, stop in windows:  # each window is freed once its matmul is queued: the next one reuses its memory
        w = dequant.dequantize_window(weight, x2d.dtype, (start, stop), (0, k)).t()
        if bias is None:
            torch.mm(x2d, w, out=out[:, start:stop])
        else:
            torch.addmm(bias[start:stop], x2d, w, out=out[:, start:stop])
        del w  # before the next window is made, not after
    return out


def _input_grad(g: torch.Tensor, weight: QuantizedWeight, accumulate: Optional[torch.Tensor] = None,
                max_windows: int = 1) -> torch.Tensor:  # fmt: skip
    """``g @ dequant(W)`` (M, K) in ``g.dtype``, W made whole or in up to ``max_windows`` column windows; added
    into ``accumulate`` (M, K) by cuBLAS (``beta=1``: the sum costs a read in the matmul's epilogue, not a pass of
    its own) when given."""
    dequant = kernels.load().dequant
    n, k = weight.shape
    windows = weight_windows(g.shape[0], n, k, k, dequant.column_alignment(weight), g.element_size(), max_windows)
    if len(windows) == 1:
        w = dequant.dequantize_triton(weight, g.dtype)
        return torch.mm(g, w) if accumulate is None else accumulate.addmm_(g, w)
    dx = torch.empty(g.shape[0], k, dtype=g.dtype, device=g.device) if accumulate is None else accumulate
    for start, stop in windows:
        w = dequant.dequantize_window(weight, g.dtype, (0, n), (start, stop))
        if accumulate is None:
            torch.mm(g, w, out=dx[:, start:stop])
        else:
            torch.addmm(dx[:, start:stop], g, w, out=dx[:, start:stop])
        del w  # before the next window is made
    return dx


def add_low_rank_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """``out += scaling * a @ b.T`` in place (``b`` is (N, r), a view is fine): the Triton pass where it applies
    (16-bit, r <= 64: at a copy's speed, ~1.5x cuBLAS' ``addmm_`` on an H100 at 8,192 rows), else ``addmm_``."""
    lowrank = kernels.load().lowrank
    if lowrank.supports(out, a):  # checked here once: shapes and dtypes match by construction
        lowrank.launch_lowrank_add_(out, a, b, scaling)
    else:
        out.addmm_(a, b.t(), alpha=scaling)


def lora_linear_forward(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor],
    weight: QuantizedWeight,
    max_windows: int = 1,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Computes ``y`` (``(*x.shape[:-1], N)`` in ``x.dtype``) and ``xa = lora_x @ A.T`` (M, r) for backward; W is
    dequantized in up to ``max_windows`` windows ([`weight_windows`])."""
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    # y is allocated in its final shape and written through a 2-D view: returned as a view made here, it would be
    # an autograd Function's view output, which autograd forbids modifying in place (``y += residual``).
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    out = _base_matmul(x2d, weight, bias, max_windows, out=y.view(-1, n))
    xa = None
    if lora_a is not None:
        lx2d = x2d if lora_x is None else _cast(lora_x, x.dtype).reshape(-1, k)
        xa = torch.mm(lx2d, _cast(lora_a, x.dtype).t())
        add_low_rank_(out, xa, _cast(lora_b, x.dtype), scaling)  # y += scaling * xa @ B.T, in place
    return y, xa


def lora_linear_backward(
    grad_out: torch.Tensor,
    grad_xa: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    lora_input: Optional[torch.Tensor],
    xa: Optional[torch.Tensor],
    bias_dtype: Optional[torch.dtype],
    scaling: float,
    needs: tuple[bool, bool, bool, bool, bool],
    separate_lora_x: bool,
    weight: QuantizedWeight,
    return_t: bool = False,
    low_rank_into_dx: bool = True,
    max_windows: int = 1,
) -> tuple[Optional[torch.Tensor], ...]:
    """Gradients ``(dx, dbias, dA, dB, dlora_x)`` of [`lora_linear_forward`]; an entry is None when not needed.

    With ``t = scaling * g @ B`` (M, r), computed once: ``dx = g @ W (+ t @ A)``, ``dlora_x = t @ A`` (when the LoRA
    branch has its own input), ``dA = t.T @ lora_x``, ``dB = scaling * g.T @ xa``, ``dbias = g.sum(0)``.

    Args:
        grad_out (`torch.Tensor`): ``dL/dy``, shape ``(*x.shape[:-1], N)``.
        grad_xa (`torch.Tensor`, *optional*): Extra ``dL/dxa`` (M, r) when xa is itself an output (custom op).
        lora_a, lora_b (`torch.Tensor`, *optional*): The adapters (any float dtype; grads come back in it).
        lora_input (`torch.Tensor`, *optional*): The LoRA branch input (``x`` or ``lora_x``); needed for dA only.
        xa (`torch.Tensor`, *optional*): ``lora_input @ A.T`` saved by the forward; needed for dB only.
        bias_dtype (`torch.dtype`, *optional*): dtype of the bias grad.
        scaling (`float`): LoRA scaling.
        needs (`tuple[bool, ...]`): Whether ``(x, bias, lora_a, lora_b, lora_x)`` need a grad; other work is skipped.
        separate_lora_x (`bool`): Whether the LoRA branch read its own ``lora_x`` (else its grad goes into dx).
        weight: The quantized base weight; dequantized again here, in ``grad_out.dtype``.
        return_t (`bool`): Also return ``t`` (6th entry; made even if nothing here needs it), for a caller that
            computes dA itself (the fused MLP down projection: from gate and up, without its input ``h``).
        low_rank_into_dx (`bool`): Whether ``t @ A`` goes into ``dx`` here; `False` returns the base term only, for a
            caller whose next pass over ``dx`` adds it (the SwiGLU backward of ``swiglu_lora.py``, with ``return_t``).
        max_windows (`int`, *optional*, defaults to 1): At most this many column windows of W for ``dx``
            ([`weight_windows`]).
    """
    need_dx, need_dbias, need_da, need_db, need_dlx = needs
    n, k = weight.shape
    g = grad_out.reshape(-1, n)
    dx = dlx = da = db = dbias = None
    t = a_cast = None
    if lora_a is not None:
        r = lora_a.shape[0]
        a_cast = _cast(lora_a, g.dtype)
        if need_da or need_dlx or return_t or (need_dx and not separate_lora_x):
            b_cast = _cast(lora_b, g.dtype)
            if grad_xa is None and xa is not None and xa.dtype == g.dtype:
                # scaling in cuBLAS' alpha: one launch instead of mm + mul_ (beta=0: xa only lends its shape)
                t = torch.addmm(xa.reshape(-1, r), g, b_cast, beta=0, alpha=scaling)
            elif grad_xa is None:
                t = torch.mm(g, b_cast).mul_(scaling)
            else:
                t = torch.addmm(_cast(grad_xa.reshape(-1, r), g.dtype), g, b_cast, alpha=scaling)
        if need_db:
            db = lora_b_grad(g, xa.reshape(-1, r), lora_b, scaling)
        if need_da:
            da = _matmul(t.t(), _cast(lora_input.reshape(-1, k), g.dtype), lora_a.dtype)
        if need_dlx and separate_lora_x:
            dlx = torch.mm(t, a_cast).view(*grad_out.shape[:-1], k)
    if need_dx:
        dx = _input_grad(g, weight, None, max_windows)
        if t is not None and not separate_lora_x and low_rank_into_dx:
            add_low_rank_(dx, t, a_cast.t(), 1.0)  # dx += (scaling * g @ B) @ A, in place
        dx = dx.view(*grad_out.shape[:-1], k)
    if need_dbias:
        dbias = g.sum(0, dtype=torch.float32).to(bias_dtype)
    return (dx, dbias, da, db, dlx, t) if return_t else (dx, dbias, da, db, dlx)


def save_for_backward(ctx, x, bias, lora_a, lora_b, scaling, lora_x, xa) -> None:
    """What both wrappers keep for backward: the LoRA input (only if A needs a grad), xa, A, B; never W."""
    ctx.separate = lora_x is not None
    ctx.scaling = scaling
    ctx.bias_dtype = None if bias is None else bias.dtype
    need_da = lora_a is not None and ctx.needs_input_grad[LORA_A]
    lora_input = (lora_x if ctx.separate else x) if need_da else None
    ctx.save_for_backward(lora_input, xa, lora_a, lora_b)


def needed_grads(ctx) -> tuple[bool, bool, bool, bool, bool]:
    """Whether ``(x, bias, lora_a, lora_b, lora_x)`` need a grad, read the same way by both wrappers."""
    nig = ctx.needs_input_grad
    return nig[X], nig[BIAS], nig[LORA_A], nig[LORA_B], ctx.separate and nig[LORA_X]


class LoraLinearFunction(torch.autograd.Function):
    """The eager autograd wrapper (the custom op's twin, same argument order); the quantized weight gets no grad."""

    @staticmethod
    def forward(ctx, x, bias, lora_a, lora_b, scaling, lora_x, weight):
        out, xa = lora_linear_forward(x, bias, lora_a, lora_b, scaling, lora_x, weight, PLAIN_LAYER_WINDOWS)
        save_for_backward(ctx, x, bias, lora_a, lora_b, scaling, lora_x, xa)
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lora_input, xa, lora_a, lora_b = ctx.saved_tensors
        grads = lora_linear_backward(grad_out, None, lora_a, lora_b, lora_input, xa, ctx.bias_dtype, ctx.scaling,
                                     needed_grads(ctx), ctx.separate, ctx.weight,
                                     max_windows=PLAIN_LAYER_WINDOWS)  # fmt: skip
        dx, dbias, da, db, dlx = grads
        return dx, dbias, da, db, None, dlx, None
