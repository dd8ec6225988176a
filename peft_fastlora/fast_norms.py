"""The fast path's RMSNorms: where Liger-Kernel patched a norm with its "llama" casting (Llama, Mistral, Qwen2/3 and
the others transformers normalises that way), training forwards run [`~peft_fastlora.ops.rms_norm`] instead.

Same math as Liger's kernel, but a backward at a copy's rate: Liger's RMSNorm backward walks the rows one SM at a time
so that it can sum the weight's gradient, which LoRA never asks for (the norms are frozen); it took 94 us for the
input gradient of 8,192 x 4,096 bf16 rows on an H200, 1.5 ms of the batch-4 step over its 16 norms
(``ops/kernels/rms_norm.py``). Evaluation, generation and compiled blocks keep Liger's forward (its patch is kept as
the forward this one replaced). This module reads two attributes Liger's patch sets on each norm, ``casting_mode``
and ``offset``, and recognises the patch by its forward's qualified name, ``LigerRMSNorm.forward``; a Liger release
that renames them leaves its norms as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from ._forward import InstanceForward, set_instance_forward
from .ops import RMSNormFunction
from .ops.rms_norm import supports as rms_norm_supports

_LIGER_FORWARD = "LigerRMSNorm.forward"


def apply_rms_norms(hf_model: nn.Module) -> int:
    """Routes the training forwards of ``hf_model``'s Liger "llama" RMSNorms through ``ops.rms_norm``; returns how
    many norms do so (those done by an earlier call included)."""
    count = 0
    for module in hf_model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, InstanceForward) and forward.__func__ is _rms_norm_forward:
            count += 1
        elif _liger_llama_norm(module, forward):
            set_instance_forward(module, _rms_norm_forward)
            count += 1
    return count


def _liger_llama_norm(module: nn.Module, forward) -> bool:
    weight = getattr(module, "weight", None)
    return (getattr(getattr(forward, "__func__", None), "__qualname__", None) == _LIGER_FORWARD
            and getattr(module, "casting_mode", None) == "llama"
            and isinstance(getattr(module, "offset", None), (int, float))
            and isinstance(weight, torch.Tensor) and weight.dim() == 1)  # fmt: skip


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``ops.rms_norm`` where a backward will follow (the input needs a gradient); else Liger's forward. (Off CUDA
    ``ops.rms_norm`` is its pure-torch twin: Liger's kernels need CUDA anyway.)"""
    if (hidden_states.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and rms_norm_supports(hidden_states, self.weight)):  # fmt: skip
        # the op's own door would check the same again: this runs once per norm per step
        return RMSNormFunction.apply(hidden_states, self.weight, float(self.variance_epsilon), float(self.offset))
    return self.forward.__wrapped__(hidden_states)
