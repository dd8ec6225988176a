"""FastLoRA layers over bitsandbytes ``Linear4bit`` and ``Linear8bitLt``, and their PEFT dispatch functions."""

from __future__ import annotations

import warnings
from typing import Optional

import bitsandbytes as bnb
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .bnb_weights import int8_from_bnb, packed4bit_from_bnb
from .distributed import restore_quant_state
from .layer import WEIGHT_CACHE, FastLoraLayer, param
from .ops.quant_state import Int8Rowwise, Packed4bit


def _restore_standard_packing(base: bnb.nn.Linear4bit) -> None:
    """Undoes bitsandbytes' CPU-only repacking (done by its eval-mode CPU forward): back to the usual layout."""
    weight = base.weight
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        warnings.warn(
            "This 4-bit layer was repacked by bitsandbytes' CPU inference path; restoring bitsandbytes' standard "
            "layout (its absmax was rounded to bf16 by that repacking).",
            stacklevel=3,
        )
        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)


class FastLoraLinear4bit(FastLoraLayer):
    """FastLoRA over ``bnb.nn.Linear4bit`` (NF4/FP4, any blocksize, double quantization, any ``quant_storage``)."""

    def quantized_weight(self) -> Packed4bit:
        base = self._base()
        weight = param(base, "weight")
        state = getattr(weight, "quant_state", None)
        if state is None or getattr(state, "packing_format_for_cpu", False):
            restore_quant_state(base)  # FSDP swaps in a plain all-gathered tensor without bitsandbytes' quant_state
            _restore_standard_packing(base)
            weight = param(base, "weight")
            state = weight.quant_state
        if torch.compiler.is_compiling():  # data_ptr() is opaque to dynamo; compiled graphs don't need the cache
            return packed4bit_from_bnb(weight.data, state)
        # Reuse the container while the weight is the same storage with the same quant_state: the kernels cache
        # their validated launch arguments on it, which keeps per-call host time down. A merge, a device move or a
        # new quant_state changes the key. (Read with Params4bit's __torch_function__ off: it costs a microsecond a
        # tensor attribute, on every layer call.)
        with torch._C.DisableTorchFunctionSubclass():
            key = (weight.data_ptr(), weight.device, id(state), id(state.absmax))
        cached = self.__dict__.get(WEIGHT_CACHE)
        if cached is None or cached[0] != key:
            cached = (key, packed4bit_from_bnb(weight.data, state))
            self.__dict__[WEIGHT_CACHE] = cached
        return cached[1]

    def store_weight(self, weight: torch.Tensor) -> None:
        base = self.get_base_layer()
        old = base.weight
        state = old.quant_state
        new = bnb.nn.Params4bit(
            weight.to(state.dtype).to("cpu"),
            requires_grad=False,
            blocksize=state.blocksize,
            compress_statistics=bool(state.nested),
            quant_type=state.quant_type,
            quant_storage=getattr(old, "quant_storage", torch.uint8),
            module=base,
        )
        base.weight = new.to(old.device)


class FastLoraLinear8bit(FastLoraLayer):
    """FastLoRA over ``bnb.nn.Linear8bitLt`` (weight-only int8: ``W = CB * SCB / 127``, no activation quantization)."""

    def quantized_weight(self) -> Int8Rowwise:
        weight = param(self._base(), "weight")
        if torch.compiler.is_compiling():
            return int8_from_bnb(weight)
        scb = getattr(weight, "SCB", None)
        with torch._C.DisableTorchFunctionSubclass():  # as for 4-bit: no __torch_function__ per attribute read
            key = (weight.data_ptr(), weight.device, None if scb is None else scb.data_ptr())
        cached = self.__dict__.get(WEIGHT_CACHE)
        if cached is None or cached[0] != key:
            cached = (key, int8_from_bnb(weight))
            self.__dict__[WEIGHT_CACHE] = cached
        return cached[1]

    def store_weight(self, weight: torch.Tensor) -> None:
        base = self.get_base_layer()
        old = base.weight
        new = bnb.nn.Int8Params(weight.to(torch.float16).to("cpu"), requires_grad=False, has_fp16_weights=False)
        base.weight = new.to(old.device)
        base.state.reset_grads()
        base.state.SCB = base.weight.SCB


def _base_of(target: nn.Module) -> nn.Module:
    return target.get_base_layer() if isinstance(target, BaseTunerLayer) else target


def dispatch_bnb_4bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[FastLoraLinear4bit]:
    """PEFT dispatcher: a [`FastLoraLinear4bit`] for a ``bnb.nn.Linear4bit`` target, else ``None``."""
    if isinstance(_base_of(target), bnb.nn.Linear4bit):
        return FastLoraLinear4bit(target, adapter_name, config=config, **kwargs)
    return None


def dispatch_bnb_8bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[FastLoraLinear8bit]:
    """PEFT dispatcher: a [`FastLoraLinear8bit`] for a quantized ``bnb.nn.Linear8bitLt`` target, else ``None``.

    An 8-bit layer that still keeps fp16 weights (``has_fp16_weights=True``) is not quantized; PEFT's own layer
    handles it.
    """
    base = _base_of(target)
    if isinstance(base, bnb.nn.Linear8bitLt) and not base.state.has_fp16_weights:
        return FastLoraLinear8bit(target, adapter_name, config=config, **kwargs)
    return None


DISPATCHERS = (dispatch_bnb_4bit, dispatch_bnb_8bit)
