"""A SwiGLU MLP whose three projections carry one LoRA adapter each, as one autograd op:
``y = down(silu(gate(x)) * up(x))``, each projection ``p(v) = v @ dequant(W).T + s * (v @ A.T) @ B.T``.

Why: apart from its matmuls with W, a LoRA projection on ``M`` tokens costs passes over activations. Unfused
(``lora_linear``), each projection adds its low-rank term in place (``y += s xa @ B.T``: reads and writes the
``(M, out_features)`` output once more), and each backward adds ``t @ A`` into ``dx`` in place; autograd then sums the
gate's and the up projection's ``dx``. At 8,192 tokens of a Llama-3-8B layer those passes took ~1 ms of a ~16 ms
layer step on an H100 (in-place adds at ~1.9 TB/s with cuBLAS' ``addmm_``; ``kernels/lowrank.py`` now runs them at a
copy's speed). Here the low-rank term rides in the base matmul, concatenated
along its reduction dimension:

    v @ W.T + s (v @ A.T) @ B.T  =  [v | s v @ A.T] @ [W | B].T          (forward: K grows by r)
    dg @ Wg + du @ Wu + tg @ Ag + tu @ Au  =  [dg | du | tg | tu] @ [Wg ; Wu ; Ag ; Au]   (backward, t = s g @ B)

so each projection's output is written once, by cuBLAS, and the MLP's input gradient is one matmul. The extra
columns are r per adapter (~0.4 % more multiply-adds at r = 16); what it costs instead is one copy of the input into
the wider matrix (``[x | s x @ Ag.T | s x @ Au.T]``, shared by gate and up, and the down projection's input is written
there by the SwiGLU kernel itself), one of the incoming gradient (``[g | t_d]``), and the adapter factors copied next
to each dequantized weight window. ``h`` is never kept: backward takes ``dA_d`` from gate and up in the SwiGLU
backward's pass, as ``swiglu_lora.py`` does; ``x`` is kept once, inside the wider matrix.

Numerics: the base and the LoRA term are summed in fp32 inside one matmul and rounded once (the unfused path rounds
the base product, then the sum); ``s * x @ A.T`` is rounded to the activation dtype, as ``xa`` is there.

[`lora_mlp`] is the door: it checks its arguments and, on CPU tensors (without ``PEFT_FASTLORA_FORCE_TRITON=1``) or
while ``torch.compile`` traces, runs the plain composition of ``fastlora_linear`` and ``silu_mul`` instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import kernels
from .dispatch import _use_triton, check_linear_args, fastlora_linear, without_autocast
from .lora_linear import ROW_WINDOW_ALIGN, _cast, _matmul, fused_op_windows, lora_b_grad, weight_windows
from .quant_state import QuantizedWeight
from .reference import silu_mul_ref


class LoraProjection(NamedTuple):
    """One LoRA projection of a fused op: its quantized weight ``(out_features, in_features)``, its adapter
    (``lora_a`` ``(r, in_features)``, ``lora_b`` ``(out_features, r)``, ``scaling``) and its bias
    (``(out_features,)``; [`lora_mlp`] takes none, ``lora_group.lora_linear_group`` does)."""

    weight: QuantizedWeight
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: Optional[torch.Tensor] = None


def _window_align(weights: list[QuantizedWeight]) -> int:
    """Column windows common to ``weights`` (multiples of each one's alignment), 0 if one of them takes none."""
    dequant = kernels.load().dequant
    aligns = [dequant.column_alignment(w) for w in weights]
    return 0 if 0 in aligns else math.lcm(*aligns)


def concat_forward(a: torch.Tensor, weight: QuantizedWeight, lora_cols: list[tuple[int, torch.Tensor]],
                   max_windows: int = 1) -> torch.Tensor:  # fmt: skip
    """``a @ [dequant(W) | L].T`` (M, N), where ``a`` is ``(M, K + extra)`` and ``L`` (N, extra) is zero but for
    ``lora_cols``: ``(column, B)`` pairs placing ``B`` (N, r) at columns ``K + column`` of it. W is made in up to
    ``max_windows`` row windows (as ``lora_linear._base_matmul``), each next to its rows of ``L`` in one buffer."""
    dequant = kernels.load().dequant
    n, k = weight.shape
    rows, width = a.shape
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    windows = weight_windows(rows, n, width, n, ROW_WINDOW_ALIGN, a.element_size(), max_windows)
    buf = torch.empty(max(stop - start for start, stop in windows), width, dtype=a.dtype, device=a.device)
    covered = sum(b.shape[1] for _, b in lora_cols)
    if covered < width - k:  # columns no adapter writes: zero once, the windows only overwrite the others
        buf[:, k:].zero_()
    for start, stop in windows:
        part = buf[: stop - start]
        dequant.dequantize_window(weight, a.dtype, (start, stop), (0, k), out=part[:, :k])
        for column, b in lora_cols:
            part[:, k + column : k + column + b.shape[1]].copy_(b[start:stop])
        torch.mm(a, part.t(), out=out[:, start:stop])
    return out


def concat_input_grad(g: torch.Tensor, weights: list[QuantizedWeight], lora_rows: torch.Tensor,
                      out: Optional[torch.Tensor] = None, max_windows: int = 1) -> torch.Tensor:  # fmt: skip
    """``g @ [dequant(W_1) ; ... ; dequant(W_n) ; L]`` (M, K) for ``g`` (M, sum of out_features + rows of ``L``),
    the weights stacked in order and ``L`` (r_total, K) the adapters' ``A`` factors; in up to ``max_windows`` column
    windows of the result (as ``lora_linear._input_grad``), written into ``out`` when given."""
    dequant = kernels.load().dequant
    k = weights[0].shape[1]
    rows, height = g.shape
    if out is None:
        out = torch.empty(rows, k, dtype=g.dtype, device=g.device)
    windows = weight_windows(rows, height, k, k, _window_align(weights), g.element_size(), max_windows)
    for start, stop in windows:
        buf = torch.empty(height, stop - start, dtype=g.dtype, device=g.device)
        row = 0
        for weight in weights:
            n = weight.shape[0]
            dequant.dequantize_window(weight, g.dtype, (0, n), (start, stop), out=buf[row : row + n])
            row += n
        buf[row:].copy_(lora_rows[:, start:stop])
        torch.mm(g, buf, out=out[:, start:stop])
        del buf  # before the next window is made
    return out


def _scaled_mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``out = scaling * a @ b`` in one cuBLAS call (``out`` may be a column block of a wider matrix)."""
    return torch.addmm(out, a, b, beta=0, alpha=scaling, out=out)


def gate_up_forward(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, max_windows: int = 1):
    """``(gate_out, up_out, xc)`` for ``x`` (M, hidden), where ``xc = [x | s_g x @ Ag.T | s_u x @ Au.T]`` (kept for
    backward: x once, and both projections' ``xa``); each W in up to ``max_windows`` windows."""
    dtype = x.dtype
    rows, k = x.shape
    r_g = gate.lora_a.shape[0]
    xc = torch.empty(rows, k + r_g + up.lora_a.shape[0], dtype=dtype, device=x.device)
    xc[:, :k].copy_(x)
    a_g, a_u = _cast(gate.lora_a, dtype), _cast(up.lora_a, dtype)
    if gate.scaling == up.scaling:  # one matmul for both factors
        _scaled_mm_into(xc[:, k:], x, torch.cat([a_g, a_u]).t(), gate.scaling)
    else:
        _scaled_mm_into(xc[:, k : k + r_g], x, a_g.t(), gate.scaling)
        _scaled_mm_into(xc[:, k + r_g :], x, a_u.t(), up.scaling)
    gate_out = concat_forward(xc, gate.weight, [(0, _cast(gate.lora_b, dtype))], max_windows)
    up_out = concat_forward(xc, up.weight, [(r_g, _cast(up.lora_b, dtype))], max_windows)
    return gate_out, up_out, xc


def gate_up_backward(d: torch.Tensor, xc: torch.Tensor, gate: LoraProjection, up: LoraProjection,
                     needs: tuple[bool, ...], max_windows: int = 1) -> tuple[Optional[torch.Tensor], ...]:  # fmt: skip
    """``(dx, dA_g, dB_g, dA_u, dB_u)`` of [`gate_up_forward`] (those ``needs`` asks for), from
    ``d = [d gate | d up | . | .]`` (M, 2 * intermediate + r_g + r_u), whose last columns this fills with
    ``t_g = s_g dg @ Bg`` and ``t_u``, so that ``dx`` is one matmul with ``[Wg ; Wu ; Ag ; Au]`` (in up to
    ``max_windows`` windows)."""
    need_dx, need_da_g, need_db_g, need_da_u, need_db_u = needs
    dtype = d.dtype
    inter, k = gate.weight.shape
    r_g = gate.lora_a.shape[0]
    dg, du = d[:, :inter], d[:, inter : 2 * inter]
    x, xa_g, xa_u = xc[:, :k], xc[:, k : k + r_g], xc[:, k + r_g :]
    dx = da_g = da_u = None
    db_g = lora_b_grad(dg, xa_g, gate.lora_b) if need_db_g else None  # xa already carries s
    db_u = lora_b_grad(du, xa_u, up.lora_b) if need_db_u else None
    if not (need_dx or need_da_g or need_da_u):
        return dx, da_g, db_g, da_u, db_u
    t_g = _scaled_mm_into(d[:, 2 * inter : 2 * inter + r_g], dg, _cast(gate.lora_b, dtype), gate.scaling)
    t_u = _scaled_mm_into(d[:, 2 * inter + r_g :], du, _cast(up.lora_b, dtype), up.scaling)
    if need_da_g or need_da_u:
        if gate.lora_a.dtype == up.lora_a.dtype:  # both factors' grads in one pass over x
            da = _matmul(d[:, 2 * inter :].t(), x, gate.lora_a.dtype)
            da_g, da_u = da[:r_g], da[r_g:]
        else:
            da_g, da_u = _matmul(t_g.t(), x, gate.lora_a.dtype), _matmul(t_u.t(), x, up.lora_a.dtype)
        da_g, da_u = (da_g if need_da_g else None), (da_u if need_da_u else None)
    if need_dx:
        a_gu = torch.cat([_cast(gate.lora_a, dtype), _cast(up.lora_a, dtype)])
        dx = concat_input_grad(d, [gate.weight, up.weight], a_gu, max_windows=max_windows)
    return dx, da_g, db_g, da_u, db_u


def swiglu_down_forward(gate_out: torch.Tensor, up_out: torch.Tensor, down: LoraProjection, max_windows: int = 1):
    """``(y, xa_d)``: the down projection of ``h = silu(gate_out) * up_out``, with ``xa_d = s_d h @ Ad.T`` for
    backward; h is written by the SwiGLU kernel straight into ``[h | xa_d]`` and dropped on return. W in up to
    ``max_windows`` windows."""
    dtype = gate_out.dtype
    rows, inter = gate_out.shape
    hc = torch.empty(rows, inter + down.lora_a.shape[0], dtype=dtype, device=gate_out.device)
    kernels.load().swiglu.silu_mul(gate_out, up_out, out=hc[:, :inter])
    _scaled_mm_into(hc[:, inter:], hc[:, :inter], _cast(down.lora_a, dtype).t(), down.scaling)
    y = concat_forward(hc, down.weight, [(0, _cast(down.lora_b, dtype))], max_windows)
    return y, hc[:, inter:].clone()


def swiglu_down_backward(grad_y: torch.Tensor, gate_out: torch.Tensor, up_out: torch.Tensor, xa_d: torch.Tensor,
                         down: LoraProjection, extra: int, needs: tuple[bool, ...], max_windows: int = 1):  # fmt: skip
    """``(d, dA_d, dB_d)`` of [`swiglu_down_forward`]: ``d = [d gate | d up | extra columns]`` (None unless ``needs``
    asks for the gate / up grads; the extra columns, uninitialised, are for [`gate_up_backward`]); W in up to
    ``max_windows`` windows."""
    need_dgu, need_da_d, need_db_d = needs
    swiglu = kernels.load().swiglu
    dtype = grad_y.dtype
    rows, k = grad_y.shape
    inter, r_d = gate_out.shape[1], down.lora_a.shape[0]
    # t_d = s_d g @ Bd, written next to g: dh = [g | t_d] @ [Wd ; Ad]
    gc = torch.empty(rows, k + r_d, dtype=dtype, device=grad_y.device)
    t_d = _scaled_mm_into(gc[:, k:], grad_y, _cast(down.lora_b, dtype), down.scaling)
    db_d = lora_b_grad(grad_y, xa_d, down.lora_b) if need_db_d else None  # xa_d already carries s_d
    # dA_d = t_d.T @ h is computed in the SwiGLU backward's pass over gate and up (or alone): h is never made
    if not need_dgu:
        da_d = swiglu.silu_mul_t_matmul(t_d, gate_out, up_out).to(down.lora_a.dtype) if need_da_d else None
        return None, da_d, db_d
    gc[:, :k].copy_(grad_y)
    d = torch.empty(rows, 2 * inter + extra, dtype=dtype, device=grad_y.device)
    concat_input_grad(gc, [down.weight], _cast(down.lora_a, dtype), d[:, :inter], max_windows)  # dh, where d gate goes
    t_d = t_d.clone() if need_da_d else None  # (M, r): lets the (M, K + r) gc go now
    del gc
    dh, d_up = d[:, :inter], d[:, inter : 2 * inter]
    if need_da_d:
        _, _, da_d = swiglu.silu_mul_backward_lora(dh, gate_out, up_out, t_d, grad_h_is_scratch=True, out_up=d_up)
        da_d = da_d.to(down.lora_a.dtype)
    else:
        da_d = None
        swiglu.silu_mul_backward(dh, gate_out, up_out, grad_h_is_scratch=True, out_up=d_up)
    return d, da_d, db_d


def _wide_grad(d_gate: torch.Tensor, d_up: torch.Tensor, extra: int) -> torch.Tensor:
    """``[d gate | d up | extra columns]`` as one matrix: the buffer [`SwiGLUDownFunction`] wrote them into when
    autograd hands them over unchanged (the MLP's own graph), else a copy."""
    rows, inter = d_gate.shape
    width = 2 * inter + extra
    storage = d_gate.untyped_storage()
    adjacent = (storage.data_ptr() == d_up.untyped_storage().data_ptr() and d_gate.dtype == d_up.dtype
                and d_gate.stride() == d_up.stride() == (width, 1)
                and d_up.storage_offset() == d_gate.storage_offset() + inter
                and storage.nbytes() >= (d_gate.storage_offset() + rows * width) * d_gate.element_size())  # fmt: skip
    if adjacent:
        return d_gate.as_strided((rows, width), (width, 1))
    d = torch.empty(rows, width, dtype=d_gate.dtype, device=d_gate.device)
    d[:, :inter].copy_(d_gate)
    d[:, inter : 2 * inter].copy_(d_up)
    return d


class LoraGateUpFunction(torch.autograd.Function):
    """``(x, A_g, B_g, A_u, B_u, s_g, s_u, W_g, W_u) -> (gate, up)`` for a 2-D ``x``; saves ``[x | x A.T]`` and the
    adapters. A separate op from the down projection's so that autograd frees gate and up (kept by that one) before
    this backward's matmul with both weights."""

    @staticmethod
    def forward(ctx, x, a_g, b_g, a_u, b_u, s_g, s_u, w_g, w_u):
        projections = (LoraProjection(w_g, a_g, b_g, s_g), LoraProjection(w_u, a_u, b_u, s_u))
        windows = fused_op_windows()
        gate_out, up_out, xc = gate_up_forward(x, *projections, windows.forward)
        ctx.save_for_backward(xc, a_g, b_g, a_u, b_u)
        ctx.weights, ctx.scalings, ctx.windows = (w_g, w_u), (s_g, s_u), windows.backward
        return gate_out, up_out

    @staticmethod
    def backward(ctx, d_gate, d_up):
        xc, a_g, b_g, a_u, b_u = ctx.saved_tensors
        (w_g, w_u), (s_g, s_u) = ctx.weights, ctx.scalings
        if d_gate is None or d_up is None:  # one output unused by the graph: its grad is zero
            d_gate = torch.zeros_like(d_up) if d_gate is None else d_gate
            d_up = torch.zeros_like(d_gate) if d_up is None else d_up
        d = _wide_grad(d_gate, d_up, a_g.shape[0] + a_u.shape[0])
        projections = (LoraProjection(w_g, a_g, b_g, s_g), LoraProjection(w_u, a_u, b_u, s_u))
        grads = gate_up_backward(d, xc, *projections, ctx.needs_input_grad[:5], ctx.windows)
        return (*grads, None, None, None, None)


class SwiGLUDownFunction(torch.autograd.Function):
    """``(gate, up, A_d, B_d, s_d, W_d, extra) -> y``; saves gate, up, ``h A.T`` and the adapter, never h. Its grads
    of gate and up are the first columns of one ``(M, 2 * intermediate + extra)`` buffer, whose last ``extra``
    columns [`LoraGateUpFunction`]'s backward fills."""

    @staticmethod
    def forward(ctx, gate_out, up_out, a_d, b_d, s_d, w_d, extra):
        windows = fused_op_windows()
        y, xa_d = swiglu_down_forward(gate_out, up_out, LoraProjection(w_d, a_d, b_d, s_d), windows.forward)
        ctx.save_for_backward(gate_out, up_out, xa_d, a_d, b_d)
        ctx.weight, ctx.scaling, ctx.extra, ctx.windows = w_d, s_d, extra, windows.backward
        return y

    @staticmethod
    def backward(ctx, grad_y):
        gate_out, up_out, xa_d, a_d, b_d = ctx.saved_tensors
        nig = ctx.needs_input_grad
        needs = (nig[0] or nig[1], nig[2], nig[3])
        down = LoraProjection(ctx.weight, a_d, b_d, ctx.scaling)
        d, da_d, db_d = swiglu_down_backward(grad_y.contiguous(), gate_out, up_out, xa_d, down, ctx.extra, needs,
                                             ctx.windows)  # fmt: skip
        inter = gate_out.shape[1]
        d_gate, d_up = (None, None) if d is None else (d[:, :inter], d[:, inter : 2 * inter])
        return d_gate, d_up, da_d, db_d, None, None, None


def lora_mlp_ref(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> torch.Tensor:
    """The plain composition (twin of the fused ops, [`lora_mlp`] and ``swiglu_lora.grouped_lora_mlp``):
    ``down(silu(gate(x)) * up(x))`` through ``fastlora_linear`` (biases included)."""
    g = fastlora_linear(x, gate.weight, gate.bias, gate.lora_a, gate.lora_b, gate.scaling)
    u = fastlora_linear(x, up.weight, up.bias, up.lora_a, up.lora_b, up.scaling)
    return fastlora_linear(silu_mul_ref(g, u), down.weight, down.bias, down.lora_a, down.lora_b, down.scaling)


def check_mlp_args(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> None:
    """Raises a clear error for projections that do not make a SwiGLU MLP on ``x``."""
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(p, LoraProjection):
            raise TypeError(f"`{name}` must be a LoraProjection(weight, lora_a, lora_b, scaling), got {type(p)}.")
        if p.lora_a is None or p.lora_b is None:
            raise ValueError(f"`{name}` has no adapter (lora_a / lora_b is None); call the projections unfused.")
        if p.bias is not None:
            raise ValueError(f"`{name}` has a bias; the fused MLP takes none: call the projections unfused.")
    check_linear_args(x, gate.weight, None, gate.lora_a, gate.lora_b, None)
    check_linear_args(x, up.weight, None, up.lora_a, up.lora_b, None)
    check_mlp_shapes(x, gate, up, down)


def check_mlp_shapes(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> None:
    """Raises a clear error unless gate and up are ``(intermediate, hidden)`` and down ``(hidden, intermediate)``, and
    down's bias and adapter fit its weight (the fused MLPs' check beyond each gate / up projection's own)."""
    inter, hidden = gate.weight.shape
    if up.weight.shape != gate.weight.shape or down.weight.shape != (hidden, inter):
        raise ValueError(f"`gate`, `up`, `down` weights must be ({inter}, {hidden}), ({inter}, {hidden}) and "
                         f"({hidden}, {inter}), got {gate.weight.shape}, {up.weight.shape}, "
                         f"{down.weight.shape}.")  # fmt: skip
    check_linear_args(torch.empty((0, inter), dtype=x.dtype, device=x.device), down.weight, down.bias, down.lora_a,
                      down.lora_b, None)  # fmt: skip


def lora_mlp_fusable(gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> bool:
    """Whether the fused op can take these projections: each weight cut into column windows of whole blocks (4-bit
    rows of whole absmax blocks: every real model; the weight buffers then take the adapter factors beside them)."""
    return bool(_window_align([gate.weight, up.weight])) and bool(_window_align([down.weight]))


def lora_mlp(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for three LoRA projections of quantized weights (no biases, no dropout),
    with each low-rank term inside its projection's matmul (see the module docstring).

    Args:
        x (`torch.Tensor`): ``(..., hidden)``, the MLP's input.
        gate, up, down ([`LoraProjection`]): The three projections; gate and up ``(intermediate, hidden)``, down
            ``(hidden, intermediate)``, each with its adapter (any float dtype; grads come back in it).

    Returns:
        `torch.Tensor`: ``(..., hidden)`` in ``x``'s dtype (the autocast dtype under autocast).
    """
    check_mlp_args(x, gate, up, down)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))  # as the projections' nn.Linear would cast it
    if not _use_triton(x.device) or torch.compiler.is_compiling() or not lora_mlp_fusable(gate, up, down):
        return lora_mlp_ref(x, gate, up, down)
    lead = x.shape[:-1]
    if torch.is_autocast_enabled(device_type):
        y = without_autocast(device_type, _fused, x.reshape(-1, x.shape[-1]), gate, up, down)
    else:
        y = _fused(x.reshape(-1, x.shape[-1]), gate, up, down)
    return y.view(*lead, y.shape[-1])


def _fused(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> torch.Tensor:
    """The two ops of the fused MLP on a 2-D ``x`` (see [`LoraGateUpFunction`] for why two)."""
    adapters = (gate.lora_a, gate.lora_b, up.lora_a, up.lora_b)
    scalings = (float(gate.scaling), float(up.scaling))
    gate_out, up_out = LoraGateUpFunction.apply(x, *adapters, *scalings, gate.weight, up.weight)
    extra = gate.lora_a.shape[0] + up.lora_a.shape[0]
    return SwiGLUDownFunction.apply(gate_out, up_out, down.lora_a, down.lora_b, float(down.scaling), down.weight,
                                    extra)  # fmt: skip
