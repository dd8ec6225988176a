"""The opt-in fp16 overflow guard (``FastLoraConfig(fp16_overflow_guard=True)``).

fp16 tops out at 65504: models trained in bf16 (Gemma-style MLPs especially) can produce larger activations, which
become ``inf`` in fp16 and then ``nan`` losses. The guard clamps a FastLoRA layer's fp16 input and output to the
finite range and counts, on the device and without a host sync, how many tensors needed it.
"""

from __future__ import annotations

import torch
from torch import nn

FP16_MAX = torch.finfo(torch.float16).max


def clamp_fp16(t: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``t`` clamped to the finite fp16 range (nan -> 0); adds 1 to ``counter`` if anything was out of range.

    Out of place, so autograd passes gradients through unchanged wherever nothing was clamped.
    """
    with torch.no_grad():
        counter += (~torch.isfinite(t)).any().to(counter.dtype)
    return torch.nan_to_num(t, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)


def overflow_report(model: nn.Module) -> dict[str, int]:
    """How many clamped tensors each FastLoRA layer with the guard on has seen: ``{module_name: count}``.

    Example:

    ```py
    >>> stats = peft_fastlora.overflow_report(model)
    >>> {name: n for name, n in stats.items() if n}  # layers that overflowed
    ```
    """
    return {
        name: int(module.overflow_count.item())
        for name, module in model.named_modules()
        if getattr(module, "overflow_guard", False) and hasattr(module, "overflow_count")
    }
