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
from .lora_linear import lora_linear_backward, lora_linear_forward
from .quant_state import QuantizedWeight
from .reference import silu_mul_ref


class SwiGLULoraFunction(torch.autograd.Function):
    """``(gate, up, bias, lora_a, lora_b, scaling, weight) -> y``; saves gate, up, xa and the adapters, never h."""

    @staticmethod
    def forward(ctx, gate, up, bias, lora_a, lora_b, scaling, weight):
        swiglu = kernels.load().swiglu
        h = swiglu.silu_mul(gate, up)
        out, xa = lora_linear_forward(h, bias, lora_a, lora_b, scaling, None, weight)
        ctx.save_for_backward(gate, up, xa, lora_a, lora_b)
        ctx.scaling, ctx.weight = scaling, weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, xa, lora_a, lora_b = ctx.saved_tensors
        nig = ctx.needs_input_grad
        swiglu = kernels.load().swiglu
        need_dh, need_da = nig[0] or nig[1], nig[3]
        # dA = t.T @ h is left to the SwiGLU pass below, which reads gate and up anyway: h is never made
        needs = (need_dh, nig[2], False, nig[4], False)
        dh, dbias, _, db, _, t = lora_linear_backward(grad_out.contiguous(), None, lora_a, lora_b, None, xa,
                                                      ctx.bias_dtype, ctx.scaling, needs, False, ctx.weight,
                                                      return_t=need_da)  # fmt: skip
        dg = du = da = None
        if need_dh:  # d gate overwrites dh (read once, elementwise): one activation-sized buffer fewer at this point
            if need_da:
                dg, du, da = swiglu.silu_mul_backward_lora(dh.view(gate.shape), gate, up, t, grad_h_is_scratch=True)
            else:
                dg, du = swiglu.silu_mul_backward(dh.view(gate.shape), gate, up, grad_h_is_scratch=True)
        elif need_da:
            da = swiglu.silu_mul_t_matmul(t, gate, up)
        return dg, du, dbias, None if da is None else da.to(lora_a.dtype), db, None, None


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
