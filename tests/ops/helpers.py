"""Weights, inputs and comparisons shared by the ops tests (one convention for every file).

``make_weight`` quantizes W ~ N(0, 1/K) and ``make_inputs`` draws x ~ N(0, 1), A ~ N(0, 1/K), B ~ N(0, 1/r), so every
output is O(1) and tolerances can be absolute. Weight kinds: ``"int8"`` or
``"<nf4|fp4>[-<blocksize>][-nested][-<bf16|fp16|fp32>storage]"`` (blocksize 64 by default).
"""

from __future__ import annotations

from typing import Optional

import bitsandbytes.functional as bnbF
import torch

from peft_fastlora.bnb import packed4bit_from_bnb
from peft_fastlora.ops.lora_mlp import LoraProjection
from peft_fastlora.ops.quant_state import Int8Rowwise, Packed4bit, QuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STORAGE = {"bf16storage": torch.bfloat16, "fp16storage": torch.float16, "fp32storage": torch.float32}


def quantize(w: torch.Tensor, kind: str):
    """bitsandbytes' quantization of ``w``: ``(QuantizedWeight, packed data, QuantState)`` (None, None for int8)."""
    if kind == "int8":
        cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
        return Int8Rowwise(cb=cb, scb=scb), None, None
    quant_type, *options = kind.split("-")
    blocksize = next((int(o) for o in options if o.isdigit()), 64)
    storage = next((STORAGE[o] for o in options if o in STORAGE), torch.uint8)
    q, state = bnbF.quantize_4bit(
        w, blocksize=blocksize, quant_type=quant_type, compress_statistics="nested" in options, quant_storage=storage
    )
    return packed4bit_from_bnb(q, state), q, state


def make_weight(kind: str, n: int, k: int, device: str = DEVICE) -> QuantizedWeight:
    """A fresh random ``(n, k)`` weight of ``kind`` whose entries are ~1/sqrt(k)."""
    return quantize((torch.randn(n, k) / k**0.5).to(device), kind)[0]


def make_inputs(lead: tuple, n: int, k: int, dtype: torch.dtype, adapter_dtype: Optional[torch.dtype] = None,
                r: int = 8, device: str = DEVICE, bias: bool = True, lora: bool = True, lora_x: bool = False,
                bias_dtype: Optional[torch.dtype] = None, requires_grad: bool = False):  # fmt: skip
    """``(x, bias, lora_a, lora_b, lora_x)``; the ones not asked for are None. ``requires_grad`` makes x and the
    adapters (and lora_x) leaves that need a grad."""
    adapter_dtype = adapter_dtype or dtype
    x = torch.randn(*lead, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(bias_dtype or dtype) if bias else None
    a = (torch.randn(r, k, device=device) / k**0.5).to(adapter_dtype) if lora else None
    bb = (torch.randn(n, r, device=device) / r**0.5).to(adapter_dtype) if lora else None
    lx = torch.randn(*lead, k, device=device).to(dtype) if lora and lora_x else None
    if requires_grad:
        for t in (x, a, bb, lx):
            if t is not None:
                t.requires_grad_()
    return x, b, a, bb, lx


def dequantize_oracle(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The format read literally, element by element (vectorised only over whole tensors): the test oracle of
    ``reference.dequantize_ref``, which is written for speed instead."""
    if isinstance(weight, Int8Rowwise):
        return (weight.cb.float() * weight.scb.float()[:, None] * 7.874015718698502e-3).to(dtype)
    assert isinstance(weight, Packed4bit)
    n = weight.numel
    i = torch.arange(n, device=weight.device)
    byte = weight.data.contiguous().reshape(-1).view(torch.uint8)[i // 2].long()
    nibble = torch.where(i % 2 == 0, byte >> 4, byte & 0xF)
    block = i // weight.blocksize
    absmax = weight.absmax.reshape(-1)
    if weight.nested:
        code = weight.nested_code.float()[absmax[block].long()]
        nested_scale = weight.nested_absmax.float().reshape(-1)[block // weight.nested_blocksize]
        scale = code * nested_scale + weight.offset.float()
    else:
        scale = absmax.float()[block]
    return (weight.code.float()[nibble] * scale).reshape(weight.shape).to(dtype)


def assert_close_scaled(actual, expected, atol, rtol, name=""):
    """``assert_close`` in fp32 with ``atol`` scaled by the reference's magnitude (values here are O(1)..O(sqrt(M)))."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}"
    )


def lora_projection(kind: str, n: int, k: int, r: int, scaling: float, adapter_dtype: torch.dtype,
                    bias: bool = False, device: str = "cpu") -> LoraProjection:  # fmt: skip
    """A projection with a fresh random weight and adapter (B ~ N(0, 1/r): never zero, which would hide the LoRA
    term), and a random bias when asked for."""
    a = (torch.randn(r, k, device=device) / k**0.5).to(adapter_dtype).requires_grad_()
    b = (torch.randn(n, r, device=device) * r**-0.5).to(adapter_dtype).requires_grad_()
    c = torch.randn(n, device=device).to(adapter_dtype).requires_grad_() if bias else None
    return LoraProjection(make_weight(kind, n, k, device=device), a, b, scaling, c)


def fp32_twin(x, projections):
    """Detached fp32 copies of ``x``, biases and adapters as new leaves, and the projections holding them."""
    x_ref = x.detach().float().requires_grad_()
    twins = []
    for p in projections:
        copies = [None if t is None else t.detach().float().requires_grad_() for t in (p.lora_a, p.lora_b, p.bias)]
        twins.append(LoraProjection(p.weight, copies[0], copies[1], p.scaling, copies[2]))
    return x_ref, twins


def record_windows(monkeypatch, module) -> tuple[list, list]:
    """Makes windows form on tiny weights and replaces ``module.weight_windows`` (the name the op under test calls)
    with a recorder of the real function's answers; returns the lists it fills: the windows chosen outside a backward
    pass, and inside one."""
    from peft_fastlora.ops import lora_linear

    real = lora_linear.weight_windows
    outside, inside = [], []

    def spy(*args):
        windows = real(*args)
        (inside if torch._C._current_graph_task_id() != -1 else outside).append(windows)
        return windows

    monkeypatch.setattr(lora_linear, "MIN_WINDOW_BYTES", 1)
    monkeypatch.setattr(lora_linear, "MIN_WINDOW", 64)
    monkeypatch.setattr(module, "weight_windows", spy)
    return outside, inside
