"""LoRA projections that read one input, as one autograd op: an attention block's q, k and v projections.

``(y_1, ..., y_n) = lora_linear_group(x, [p_1, ..., p_n])`` with ``y_i = x @ dequant(W_i).T (+ b_i) + s_i (x @ A_i.T) @
B_i.T`` for [`LoraProjection`]s ``p_i`` of one ``in_features``.

Why: as n separate ``fastlora_linear`` ops, each reads ``x`` for its ``xa`` and again in backward for its ``dA``, adds
its own ``t_i @ A_i`` into its own ``dx`` (a read and a write of an (M, in_features) tensor), and autograd then sums
the n ``dx`` (n - 1 more such passes). Here ``x`` is read once for every ``xa`` (one matmul with the stacked ``A``s)
and once for every ``dA`` (one matmul with the stacked ``t``s); the base terms of ``dx`` accumulate inside cuBLAS
(``beta=1``: a read in the matmul's epilogue instead of a pass of its own); the low-rank terms go in with one pass of
rank ``r_1 + ... + r_n``.

Numerics: each output is its own base matmul plus its own in-place low-rank add, rounded as the separate op rounds it;
``dx`` is summed in fp32 inside cuBLAS and rounded once per projection instead of rounded per projection and summed in
the activation dtype by autograd.

[`lora_linear_group`] is the door: it checks its arguments and, on CPU tensors (without
``PEFT_FASTLORA_FORCE_TRITON=1``) or while ``torch.compile`` traces, runs the separate ``fastlora_linear`` ops instead
([`lora_linear_group_ref`], the twin).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .dispatch import _use_triton, check_linear_args, fastlora_linear, without_autocast
from .lora_linear import _base_matmul, _cast, _input_grad, _matmul, add_low_rank_, fused_op_windows, lora_b_grad
from .lora_mlp import LoraProjection, _scaled_mm_into


def group_forward(x: torch.Tensor, projections: Sequence[LoraProjection], add_low_rank: bool = True,
                  max_windows: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:  # fmt: skip
    """``([y_1, ..., y_n], xa)`` for a 2-D ``x`` (M, K): each ``y_i`` (M, N_i) in ``x.dtype``, and ``xa = x @ [A_1 ;
    ... ; A_n].T`` (M, r_1 + ... + r_n), kept for backward. ``add_low_rank=False``: the ``y_i`` are the base terms
    only (bias included), for a caller that adds ``s_i xa_i @ B_i.T`` in its own pass over them. Each W is made in
    up to ``max_windows`` row windows."""
    dtype = x.dtype
    xa = torch.mm(x, _stacked_a(projections, dtype).t())
    outs, col = [], 0
    for p in projections:
        r = p.lora_a.shape[0]
        out = _base_matmul(x, p.weight, p.bias, max_windows)
        if add_low_rank:
            add_low_rank_(out, xa[:, col : col + r], _cast(p.lora_b, dtype), p.scaling)
        outs.append(out)
        col += r
    return outs, xa


def group_backward(grads: Sequence[Optional[torch.Tensor]], x: Optional[torch.Tensor], xa: torch.Tensor,
                   projections: Sequence[LoraProjection], need_dx: bool, needs: Sequence[tuple[bool, bool, bool]],
                   grad_xa: Optional[torch.Tensor] = None,
                   max_windows: int = 1) -> tuple[Optional[torch.Tensor], list[tuple]]:  # fmt: skip
    """``(dx, [(dbias_i, dA_i, dB_i), ...])`` of [`group_forward`] from the outputs' grads (None: that output was not
    used, its grad is zero); ``needs[i]`` says whether ``(bias_i, A_i, B_i)`` need a grad, ``x`` (M, K) is needed only
    for the ``dA``s. An entry is None when not needed. Each W is made in up to ``max_windows`` column windows.

    ``grad_xa``: the grad of ``xa`` (M, r_1 + ... + r_n) for a forward with ``add_low_rank=False``, whose caller
    added the low-rank terms: it is the stacked ``t_i = s_i g_i @ B_i``, and the ``dB_i`` are that caller's."""
    present = [g for g in grads if g is not None]
    per: list[tuple] = [(None, None, None)] * len(projections)
    if not present and grad_xa is None:
        return None, per
    dtype = (present or [grad_xa])[0].dtype
    rows = xa.shape[0]
    need_t = need_dx or any(need_da for _, need_da, _ in needs)
    own_terms = grad_xa is None  # else the caller added the low-rank terms: t is given, and dB is the caller's
    t = grad_xa if not own_terms or not need_t else torch.empty(rows, xa.shape[1], dtype=dtype, device=xa.device)
    dx = None
    col = 0
    for i, (p, g, (need_dbias, _, need_db)) in enumerate(zip(projections, grads, needs)):
        r = p.lora_a.shape[0]
        cols = slice(col, col + r)
        col += r
        if g is None:
            if t is not None and own_terms:
                t[:, cols].zero_()
            continue
        g = g.reshape(rows, p.weight.shape[0])  # (not -1: ambiguous at zero rows)
        if t is not None and own_terms:
            _scaled_mm_into(t[:, cols], g, _cast(p.lora_b, dtype), p.scaling)
        db = lora_b_grad(g, xa[:, cols], p.lora_b, p.scaling) if need_db and own_terms else None
        dbias = g.sum(0, dtype=torch.float32).to(p.bias.dtype) if need_dbias else None
        per[i] = (dbias, None, db)
        if need_dx:
            dx = _input_grad(g, p.weight, dx, max_windows)  # the first makes dx, the others add into it (cuBLAS)
    if any(need_da for _, need_da, _ in needs):
        das = _lora_a_grads(t, x, projections, [need_da and g is not None for g, (_, need_da, _) in zip(grads, needs)])
        per = [(dbias, da, db) for (dbias, _, db), da in zip(per, das)]
    if dx is not None:
        add_low_rank_(dx, t, _stacked_a(projections, dtype).t(), 1.0)  # dx += t @ A
    return dx, per


def _stacked_a(projections: Sequence[LoraProjection], dtype: torch.dtype) -> torch.Tensor:
    """``[A_1 ; ... ; A_n]`` (r_1 + ... + r_n, K) in ``dtype``."""
    return torch.cat([_cast(p.lora_a, dtype) for p in projections])


def _lora_a_grads(t: torch.Tensor, x: torch.Tensor, projections: Sequence[LoraProjection],
                  wanted: Sequence[bool]) -> list[Optional[torch.Tensor]]:  # fmt: skip
    """``dA_i = t_i.T @ x`` in each adapter's dtype where ``wanted[i]`` (else None), ``t`` the stacked ``t_i``: one
    matmul over ``x`` where the adapters share a dtype."""
    adapter_dtypes = {p.lora_a.dtype for p in projections}
    da_all = _matmul(t.t(), x, adapter_dtypes.pop()) if len(adapter_dtypes) == 1 else None
    das, row = [], 0
    for p, want in zip(projections, wanted):
        r = p.lora_a.shape[0]
        rows = slice(row, row + r)
        if not want:
            das.append(None)
        else:
            das.append(da_all[rows] if da_all is not None else _matmul(t[:, rows].t(), x, p.lora_a.dtype))
        row += r
    return das


class LoraGroupFunction(torch.autograd.Function):
    """``(x, weights, scalings, pending, bias_1, A_1, B_1, ..., bias_n, A_n, B_n) -> (y_1, ..., y_n)`` for a 2-D
    ``x``; saves ``x`` (only if an ``A`` needs a grad), ``xa`` and the adapters, never a ``W``. ``pending``: the
    outputs are the base terms and ``xa`` is returned last, for a consumer that adds the low-rank terms (the ``B``s
    are then None: their grads are the consumer's)."""

    @staticmethod
    def forward(ctx, x, weights, scalings, pending, *params):
        projections = _projections(weights, scalings, params)
        windows = fused_op_windows()
        outs, xa = group_forward(x, projections, not pending, windows.forward)
        need_da = any(ctx.needs_input_grad[5 + 3 * i] for i in range(len(weights)))
        ctx.save_for_backward(x if need_da else None, xa, *params)
        ctx.weights, ctx.scalings, ctx.pending, ctx.windows = weights, scalings, pending, windows.backward
        ctx.set_materialize_grads(False)  # an unused output's grad stays None: no zero tensor made for it
        return (*outs, xa) if pending else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, xa, *params = ctx.saved_tensors
        projections = _projections(ctx.weights, ctx.scalings, params)
        nig = ctx.needs_input_grad
        needs = [(nig[4 + 3 * i], nig[5 + 3 * i], nig[6 + 3 * i]) for i in range(len(projections))]
        grad_xa = None
        if ctx.pending:
            *grads, grad_xa = grads
            if grad_xa is None:  # xa unused downstream: its terms added nothing
                grad_xa = torch.zeros_like(xa)
        dx, per = group_backward(grads, x, xa, projections, nig[0], needs, grad_xa, ctx.windows)
        return (dx, None, None, None, *(grad for triple in per for grad in triple))


def _projections(weights, scalings, params) -> list[LoraProjection]:
    return [LoraProjection(w, params[3 * i + 1], params[3 * i + 2], s, params[3 * i])
            for i, (w, s) in enumerate(zip(weights, scalings))]  # fmt: skip


def lora_linear_group_ref(x: torch.Tensor, projections: Sequence[LoraProjection]) -> tuple[torch.Tensor, ...]:
    """The twin of [`lora_linear_group`]: one ``fastlora_linear`` op per projection."""
    return tuple(fastlora_linear(x, p.weight, p.bias, p.lora_a, p.lora_b, p.scaling) for p in projections)


def check_group_args(x: torch.Tensor, projections: Sequence[LoraProjection]) -> None:
    """Raises a clear error for projections that cannot run as one op on ``x``."""
    if isinstance(projections, LoraProjection) or not isinstance(projections, Sequence) or not projections:
        raise TypeError(f"`projections` must be a non-empty sequence of LoraProjection, got {type(projections)}.")
    for i, p in enumerate(projections):
        if not isinstance(p, LoraProjection):
            raise TypeError(f"`projections[{i}]` must be a LoraProjection(weight, lora_a, lora_b, scaling, bias), "
                            f"got {type(p)}.")  # fmt: skip
        if p.lora_a is None or p.lora_b is None:
            raise ValueError(f"`projections[{i}]` has no adapter (lora_a / lora_b is None); call it with "
                             f"fastlora_linear instead.")  # fmt: skip
        check_linear_args(x, p.weight, p.bias, p.lora_a, p.lora_b, None)


def lora_linear_group(x: torch.Tensor, projections: Sequence[LoraProjection]) -> tuple[torch.Tensor, ...]:
    """``tuple(fastlora_linear(x, p.weight, p.bias, p.lora_a, p.lora_b, p.scaling) for p in projections)`` as one op
    that reads ``x`` once per pass and sums the input gradient inside the matmuls (see the module docstring).

    Args:
        x (`torch.Tensor`): ``(..., in_features)``, the input every projection reads.
        projections (sequence of [`LoraProjection`]): Each with its quantized weight ``(out_features_i,
            in_features)``, its adapter (any float dtype; grads come back in it) and optional bias.

    Returns:
        `tuple[torch.Tensor, ...]`: ``(..., out_features_i)`` per projection, in ``x``'s dtype (the autocast dtype
        under autocast).
    """
    check_group_args(x, projections)
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if autocast:
        x = x.to(torch.get_autocast_dtype(device_type))  # as each projection's nn.Linear would cast it
    if not _use_triton(x.device) or torch.compiler.is_compiling():
        return lora_linear_group_ref(x, projections)
    lead, k = x.shape[:-1], x.shape[-1]
    weights = tuple(p.weight for p in projections)
    scalings = tuple(float(p.scaling) for p in projections)
    params = [t for p in projections for t in (p.bias, p.lora_a, p.lora_b)]
    args = (x.reshape(-1, k), weights, scalings, False, *params)
    if autocast:
        outs = without_autocast(device_type, LoraGroupFunction.apply, *args)
    else:
        outs = LoraGroupFunction.apply(*args)
    return tuple(out.view(*lead, out.shape[-1]) for out in outs)
