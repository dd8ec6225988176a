"""The MLP down projection fused with its SwiGLU: ``y = fastlora_linear(silu(gate) * up, W, bias, A, B, scaling)``.

Why: in a SwiGLU MLP (Llama, Mistral, Qwen2, ...) the down projection's input ``h = silu(gate) * up`` is as large as
``gate`` and ``up`` (tokens x intermediate size) and the LoRA backward needs it (``dA = t.T @ h``), so an unfused
step keeps ``h`` for backward on top of ``gate`` and ``up``: 235 MB per Llama-3-8B layer at 8192 tokens. Here only
those two are kept, and backward computes ``dA`` in the SwiGLU backward's own pass over them
(``kernels.swiglu.silu_mul_backward_lora``), from ``h`` made tile by tile in registers and never written.

[`swiglu_lora_linear`] is the door (arguments checked like ``fastlora_linear``'s); [`SwiGLULoraFunction`] the
autograd wrapper around ``lora_linear_forward`` / ``lora_linear_backward`` and the SwiGLU kernels. On CPU tensors
(without ``PEFT_FASTLORA_FORCE_TRITON=1``) and while ``torch.compile`` traces, it is the plain composition of
``silu_mul`` and ``fastlora_linear`` (same math, no memory saving).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import kernels
from .dispatch import _use_triton, check_linear_args, fastlora_linear, without_autocast
from .lora_group import LoraGroupFunction, check_group_args
from .lora_linear import _cast, fused_op_windows, lora_b_grad, lora_linear_backward, lora_linear_forward
from .lora_mlp import LoraProjection, _scaled_mm_into, check_mlp_shapes, lora_mlp_ref
from .quant_state import QuantizedWeight
from .reference import silu_mul_ref

# The gate and up terms' B grads (s dg.T @ xa) summed in the SwiGLU backward's pass, which makes dg and du in
# registers, instead of two cuBLAS calls that read dg and du back (2 x 235 MB at 8,192 tokens of Llama-3-8B): that
# backward with both B grads took 0.603 ms against 0.667 ms on an H100 (benchmarks/bench_lowrank.py, 2026-12-06).
B_GRADS_IN_SWIGLU_PASS = True


class SwiGLULoraFunction(torch.autograd.Function):
    """``(gate, up, bias, lora_a, lora_b, scaling, weight[, xa, b_gate, b_up, s_gate, s_up]) -> y``; saves gate, up,
    xa and the adapters, never h.

    With ``xa`` (M, r_g + r_u) and the gate and up projections' ``B``s and scalings, ``gate`` and ``up`` are base terms
    whose LoRA terms are pending (``xa`` = ``[x @ A_g.T | x @ A_u.T]``, from a [`LoraGroupFunction`] run with
    ``pending``): the SwiGLU kernels add ``s xa @ B.T`` to each tile they read, and backward adds the down
    projection's ``t @ A`` into ``dh`` the same way, so none of the three is a pass over an (M, intermediate) tensor
    of its own. Backward then returns the grads of ``xa`` (the gate and up ``t``s) and of the two ``B``s."""

    @staticmethod
    def forward(ctx, gate, up, bias, lora_a, lora_b, scaling, weight, xa_gu=None, b_gate=None, b_up=None, s_gate=0.0,
                s_up=0.0):  # fmt: skip
        swiglu = kernels.load().swiglu
        terms = _pending_terms(xa_gu, b_gate, b_up, s_gate, s_up, gate.dtype)
        h = swiglu.silu_mul(gate, up, gate_term=terms[0], up_term=terms[1])
        windows = fused_op_windows()
        out, xa = lora_linear_forward(h, bias, lora_a, lora_b, scaling, None, weight, windows.forward)
        ctx.save_for_backward(gate, up, xa, lora_a, lora_b, xa_gu, b_gate, b_up)
        ctx.scaling, ctx.weight, ctx.gate_up_scalings = scaling, weight, (s_gate, s_up)
        ctx.windows = windows.backward
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, xa, lora_a, lora_b, xa_gu, b_gate, b_up = ctx.saved_tensors
        nig = ctx.needs_input_grad
        swiglu = kernels.load().swiglu
        pending = xa_gu is not None
        need_da = nig[3]
        # the gate / up grads also make the grads of the pending terms (xa, B_g, B_u)
        need_dh = nig[0] or nig[1] or (pending and any(nig[7:10]))
        # dA = t.T @ h is left to the SwiGLU pass below, which reads gate and up anyway: h is never made. With pending
        # terms that pass also adds t @ A into dh.
        needs = (need_dh, nig[2], False, nig[4], False)
        dh, dbias, _, db, _, t = lora_linear_backward(grad_out.contiguous(), None, lora_a, lora_b, None, xa,
                                                      ctx.bias_dtype, ctx.scaling, needs, False, ctx.weight,
                                                      return_t=need_da or (pending and need_dh),
                                                      low_rank_into_dx=not pending,
                                                      max_windows=ctx.windows)  # fmt: skip
        gate_term, up_term = _pending_terms(xa_gu, b_gate, b_up, *ctx.gate_up_scalings, gate.dtype)
        dg = du = da = None
        b_products = None
        if pending and need_dh:
            dh_term = (t, _cast(lora_a, t.dtype).t(), 1.0)
            term_b_grads = B_GRADS_IN_SWIGLU_PASS and (nig[8] or nig[9])
            dg, du, da, *b_products = swiglu.silu_mul_backward_lora(
                dh.view(gate.shape), gate, up, t, grad_h_is_scratch=True, gate_term=gate_term, up_term=up_term,
                grad_h_term=dh_term, term_b_grads=term_b_grads,
            )
            da = da if need_da else None
        elif need_dh:  # d gate overwrites dh (read once, elementwise): one activation-sized buffer fewer at this point
            if need_da:
                dg, du, da = swiglu.silu_mul_backward_lora(dh.view(gate.shape), gate, up, t, grad_h_is_scratch=True)
            else:
                dg, du = swiglu.silu_mul_backward(dh.view(gate.shape), gate, up, grad_h_is_scratch=True)
        elif need_da:
            da = swiglu.silu_mul_t_matmul(t, gate, up, gate_term=gate_term, up_term=up_term)
        term_grads = (None, None, None)
        if pending and dg is not None:
            term_grads = _pending_term_grads(dg, du, xa_gu, b_gate, b_up, *ctx.gate_up_scalings, nig[7:10],
                                             b_products or None)  # fmt: skip
        dg, du = (dg if nig[0] else None), (du if nig[1] else None)
        da = None if da is None else da.to(lora_a.dtype)
        return dg, du, dbias, da, db, None, None, *term_grads, None, None


def _pending_terms(xa_gu: Optional[torch.Tensor], b_gate: Optional[torch.Tensor], b_up: Optional[torch.Tensor],
                   s_gate: float, s_up: float, dtype: torch.dtype) -> tuple:  # fmt: skip
    """The SwiGLU kernels' ``(gate_term, up_term)`` (``(a, b, scaling)``: ``+ scaling * a @ b.T``) of pending LoRA
    terms, or ``(None, None)``."""
    if xa_gu is None:
        return None, None
    r_g = b_gate.shape[1]
    return (xa_gu[:, :r_g], _cast(b_gate, dtype), s_gate), (xa_gu[:, r_g:], _cast(b_up, dtype), s_up)


def _pending_term_grads(dg: torch.Tensor, du: torch.Tensor, xa_gu: torch.Tensor, b_gate: torch.Tensor,
                        b_up: torch.Tensor, s_gate: float, s_up: float, needs,
                        b_products: Optional[list] = None) -> tuple:  # fmt: skip
    """``(d xa, d B_g, d B_u)`` of the pending terms (as ``needs`` asks): ``d xa = [s_g dg @ B_g | s_u du @ B_u]`` (the
    ``t``s the projection group's backward takes), ``d B = s g.T @ xa``; ``b_products``: the SwiGLU pass's fp32
    ``[xa_g.T @ dg, xa_u.T @ du]``, which then make the ``d B``s without another read of ``dg`` and ``du``."""
    need_dxa, need_db_g, need_db_u = needs
    r_g = b_gate.shape[1]
    rows, dtype = xa_gu.shape[0], dg.dtype  # dg, du: (rows, intermediate), as the group's 2-D base terms
    dxa = None
    if need_dxa:
        dxa = torch.empty(rows, xa_gu.shape[1], dtype=dtype, device=dg.device)
        _scaled_mm_into(dxa[:, :r_g], dg, _cast(b_gate, dtype), s_gate)
        _scaled_mm_into(dxa[:, r_g:], du, _cast(b_up, dtype), s_up)
    if b_products is not None:
        db_g, db_u = ((product.t() * s).to(b.dtype).contiguous() if need else None
                      for product, s, b, need in zip(b_products, (s_gate, s_up), (b_gate, b_up),
                                                     (need_db_g, need_db_u)))  # fmt: skip
        return dxa, db_g, db_u
    db_g = lora_b_grad(dg, xa_gu[:, :r_g], b_gate, s_gate) if need_db_g else None
    db_u = lora_b_grad(du, xa_gu[:, r_g:], b_up, s_up) if need_db_u else None
    return dxa, db_g, db_u


def swiglu_lora_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
) -> torch.Tensor:
    """``fastlora_linear(silu(gate) * up, weight, bias, lora_a, lora_b, scaling)``, keeping only ``gate`` and ``up``
    for backward.

    Args:
        gate (`torch.Tensor`): ``(..., in_features)``, the gate projection's output.
        up (`torch.Tensor`): Same shape and dtype as ``gate``, the up projection's output.
        weight, bias, lora_a, lora_b, scaling: As for [`fastlora_linear`]; the LoRA branch reads ``h`` (no dropout).
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"`gate` and `up` must have one shape, dtype and device, got {tuple(gate.shape)} "
                         f"{gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}.")  # fmt: skip
    device_type = gate.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        gate, up = gate.to(dtype), up.to(dtype)  # as the down projection's nn.Linear would cast h
    if not _use_triton(gate.device) or torch.compiler.is_compiling():
        return fastlora_linear(silu_mul_ref(gate, up), weight, bias, lora_a, lora_b, scaling)
    check_linear_args(gate, weight, bias, lora_a, lora_b, None)
    args = (gate.contiguous(), up.contiguous(), bias, lora_a, lora_b, float(scaling), weight)
    if not torch.is_autocast_enabled(device_type):
        return SwiGLULoraFunction.apply(*args)
    return without_autocast(device_type, SwiGLULoraFunction.apply, *args)


def grouped_lora_mlp(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for three LoRA projections of quantized weights (no dropout), with gate and up
    as one projection group (``lora_group.py``: ``x`` read once per pass) whose LoRA terms the SwiGLU kernels add in
    registers, and the SwiGLU fused into the down projection ([`swiglu_lora_linear`]): neither ``h`` nor the gate
    and up outputs with their LoRA terms is ever written. Numerics: those of the separate ops (each term added to its
    rounded base term in fp32, rounded once, then used), up to the order of the rank-sized sums.

    Args:
        x (`torch.Tensor`): ``(..., hidden)``, the MLP's input.
        gate, up, down ([`LoraProjection`]): The three projections (biases allowed); gate and up ``(intermediate,
            hidden)`` with ranks up to 64, down ``(hidden, intermediate)``; adapters of any float dtype (grads come
            back in it).

    Returns:
        `torch.Tensor`: ``(..., hidden)`` in ``x``'s dtype (the autocast dtype under autocast).
    """
    check_group_args(x, [gate, up])
    check_mlp_shapes(x, gate, up, down)
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if autocast:
        x = x.to(torch.get_autocast_dtype(device_type))  # as the projections' nn.Linear would cast it
    if not _use_triton(x.device) or torch.compiler.is_compiling():
        return lora_mlp_ref(x, gate, up, down)
    lead = x.shape[:-1]
    args = (x.reshape(-1, x.shape[-1]), gate, up, down)
    y = without_autocast(device_type, _grouped, *args) if autocast else _grouped(*args)
    return y.view(*lead, y.shape[-1])


def _grouped(x: torch.Tensor, gate: LoraProjection, up: LoraProjection, down: LoraProjection) -> torch.Tensor:
    """The two ops of [`grouped_lora_mlp`] on a 2-D ``x``: the group's base terms and ``xa``, then the SwiGLU down
    projection that adds their LoRA terms. Ranks over 64 (past what the kernels add in one ``tl.dot``): the group adds
    its terms in its own pass."""
    s_g, s_u = float(gate.scaling), float(up.scaling)
    down_args = (down.bias, down.lora_a, down.lora_b, float(down.scaling), down.weight)
    if max(gate.lora_a.shape[0], up.lora_a.shape[0]) > kernels.load().lowrank.MAX_RANK:
        gate_out, up_out = LoraGroupFunction.apply(x, (gate.weight, up.weight), (s_g, s_u), False, gate.bias,
                                                   gate.lora_a, gate.lora_b, up.bias, up.lora_a, up.lora_b)  # fmt: skip
        return SwiGLULoraFunction.apply(gate_out, up_out, *down_args)
    gate_base, up_base, xa = LoraGroupFunction.apply(x, (gate.weight, up.weight), (s_g, s_u), True, gate.bias,
                                                     gate.lora_a, None, up.bias, up.lora_a, None)  # fmt: skip
    return SwiGLULoraFunction.apply(gate_base, up_base, *down_args, xa, gate.lora_b, up.lora_b, s_g, s_u)
