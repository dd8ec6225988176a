"""Everything FastLoRA knows about bitsandbytes: the FastLoRA layers over ``Linear4bit`` / ``Linear8bitLt``, their PEFT
dispatch functions, and how a bitsandbytes parameter becomes the plain-tensor container ``peft_fastlora.ops`` reads.

bitsandbytes keeps parts of a quantized weight in places that move:

- 4-bit: ``Params4bit.quant_state``. FSDP replaces the parameter by a plain all-gathered tensor without it; the layer
  keeps a copy (``Linear4bit.quant_state``) that [`restore_quant_state`] puts back. bitsandbytes' eval-mode CPU forward
  repacks the weight into a CPU-only layout, which [`restore_standard_packing`] undoes.
- 8-bit: the row scales start as ``Int8Params.SCB``; the first forward of a ``Linear8bitLt`` moves them (and ``CB``) to
  ``layer.state``. [`int8_from_bnb`] reads both places.

One private bitsandbytes function is used: ``bitsandbytes.functional._convert_weight_packed_for_cpu_inverse`` (the
inverse of its CPU repacking; bitsandbytes has no public one).
"""

from __future__ import annotations

import warnings
from typing import Optional

import bitsandbytes as bnb
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .layer import FastLoraLayer, param
from .ops.quant_state import Int8Rowwise, Packed4bit


# ---- bitsandbytes parameters -> ops containers -----------------------------------------------------------------------
def packed4bit_from_bnb(data: torch.Tensor, quant_state) -> Packed4bit:
    """Builds a [`Packed4bit`] from a bitsandbytes ``Params4bit`` (or its raw data) and its ``QuantState``.

    Args:
        data (`torch.Tensor`): The packed weight (``Params4bit`` data, any ``quant_storage`` dtype).
        quant_state (`bitsandbytes.functional.QuantState`): Its quantization state.
    """
    if quant_state is None:
        raise ValueError(
            "This 4-bit weight has no `quant_state`: it was never quantized (e.g. it is still on the meta device or "
            "was not moved to a device). Load the model with `BitsAndBytesConfig(load_in_4bit=True)` first."
        )
    out_features, in_features = (int(s) for s in quant_state.shape)
    nested = bool(getattr(quant_state, "nested", False))
    state2 = quant_state.state2 if nested else None
    return Packed4bit(
        data=data,
        absmax=quant_state.absmax,
        code=quant_state.code,
        blocksize=int(quant_state.blocksize),
        shape=(out_features, in_features),
        nested_absmax=state2.absmax if nested else None,
        nested_code=state2.code if nested else None,
        nested_blocksize=int(state2.blocksize) if nested else 0,
        offset=torch.as_tensor(quant_state.offset, dtype=torch.float32, device=data.device) if nested else None,
        quant_type=str(quant_state.quant_type),
    )


def int8_scales(weight, layer_state=None) -> Optional[torch.Tensor]:
    """The row scales of an ``Int8Params``: ``weight.SCB``, or ``layer_state.SCB`` once a forward has moved them."""
    scb = getattr(weight, "SCB", None)
    if scb is None and layer_state is not None:
        scb = getattr(layer_state, "SCB", None)
    return scb


def int8_from_bnb(weight, layer_state=None) -> Int8Rowwise:
    """Builds an [`Int8Rowwise`] from a bitsandbytes ``Int8Params`` (data holds CB; the row scales are ``weight.SCB``,
    or ``layer_state.SCB`` of its ``Linear8bitLt`` after a forward).

    Args:
        weight (`bitsandbytes.nn.Int8Params`): The int8 weight.
        layer_state (`bitsandbytes.MatmulLtState`, *optional*): ``Linear8bitLt.state``, where bitsandbytes keeps the
            scales once the layer has run.
    """
    scb = int8_scales(weight, layer_state)
    if scb is None:
        raise ValueError(
            "This 8-bit weight has no `SCB` row scales, neither on the weight nor in its layer's `state`: it was "
            "never quantized (bitsandbytes quantizes an Int8Params when it is moved to a device). Load the model "
            "with `BitsAndBytesConfig(load_in_8bit=True)` first."
        )
    cb = weight.CB if getattr(weight, "CB", None) is not None else weight.data
    return Int8Rowwise(cb=cb, scb=scb)


# ---- where bitsandbytes moved the 4-bit state ------------------------------------------------------------------------
def restore_quant_state(base_layer: nn.Module) -> None:
    """Re-attaches ``quant_state`` to the weight of a bitsandbytes ``Linear4bit`` that FSDP replaced by a plain tensor.

    A no-op when the weight still has its state (no FSDP, or a ``Params4bit``). Raises if FSDP mixed precision cast
    the packed bytes to another dtype, which makes them unreadable.

    Args:
        base_layer (`nn.Module`): A ``bitsandbytes.nn.Linear4bit``.
    """
    weight = base_layer.weight
    if getattr(weight, "quant_state", None) is not None:
        return
    state = getattr(base_layer, "quant_state", None)
    if state is None:
        return  # never quantized; `packed4bit_from_bnb` raises the error that explains it
    storage = getattr(base_layer, "quant_storage", weight.dtype)
    if weight.dtype != storage:
        raise RuntimeError(
            f"The packed 4-bit weight of this layer is {weight.dtype} but was stored as {storage} "
            f"(`bnb_4bit_quant_storage`): FSDP mixed precision cast the packed bytes. Set FSDP's mixed precision "
            f"`param_dtype` to {storage}, or load the model with `bnb_4bit_quant_storage` equal to that `param_dtype`."
        )
    weight.quant_state = state  # a plain attribute on FSDP's unsharded Parameter; the parameter itself stays FSDP's


def restore_standard_packing(base: nn.Module) -> None:
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


def view_packed_as_bytes(base: nn.Module) -> bool:
    """Re-views the packed weight of a ``Linear4bit`` as ``uint8`` (same storage, bitsandbytes' default ``(n, 1)``
    layout) and makes ``uint8`` its ``quant_storage``; returns whether the data changed dtype."""
    weight = base.weight
    changed = weight.dtype != torch.uint8
    if changed:
        weight.data = weight.data.reshape(-1).view(torch.uint8).view(-1, 1)
    weight.quant_storage = torch.uint8
    base.quant_storage = torch.uint8
    return changed


# ---- layers ----------------------------------------------------------------------------------------------------------
class FastLoraLinear4bit(FastLoraLayer):
    """FastLoRA over ``bnb.nn.Linear4bit`` (NF4/FP4, any blocksize, double quantization, any ``quant_storage``)."""

    bits = 4

    def quantized_weight(self) -> Packed4bit:
        base = self._base()
        weight = param(base, "weight")
        state = getattr(weight, "quant_state", None)
        if state is None or getattr(state, "packing_format_for_cpu", False):
            restore_quant_state(base)  # FSDP swaps in a plain all-gathered tensor without bitsandbytes' quant_state
            restore_standard_packing(base)
            weight = param(base, "weight")
            state = weight.quant_state
        if torch.compiler.is_compiling():  # data_ptr() is opaque to dynamo; compiled graphs don't need the cache
            return packed4bit_from_bnb(weight.data, state)
        return self.cached_weight(self.weight_key(), lambda: packed4bit_from_bnb(weight.data, state))

    def weight_key(self) -> Optional[tuple]:
        weight = param(self._base(), "weight")
        state = getattr(weight, "quant_state", None)
        # vars(): a missing attribute costs a trip through QuantState.__getattr__, on every decode call.
        if state is None or vars(state).get("packing_format_for_cpu", False):
            return None
        # Read with Params4bit's __torch_function__ off: it costs a microsecond a tensor attribute, on every call.
        with torch._C.DisableTorchFunctionSubclass():
            return (weight.data_ptr(), weight.device, id(state), id(state.absmax))

    def configured_compute_dtype(self) -> Optional[torch.dtype]:
        return getattr(self.get_base_layer(), "compute_dtype", None)

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

    bits = 8

    def quantized_weight(self) -> Int8Rowwise:
        base = self._base()
        weight = param(base, "weight")
        state = base.__dict__.get("state")
        if torch.compiler.is_compiling():
            return int8_from_bnb(weight, state)
        return self.cached_weight(self.weight_key(), lambda: int8_from_bnb(weight, state))

    def weight_key(self) -> Optional[tuple]:
        base = self._base()
        weight = param(base, "weight")
        scb = int8_scales(weight, base.__dict__.get("state"))
        with torch._C.DisableTorchFunctionSubclass():  # as for 4-bit: no __torch_function__ per attribute read
            return (weight.data_ptr(), weight.device, None if scb is None else scb.data_ptr())

    def store_weight(self, weight: torch.Tensor) -> None:
        base = self.get_base_layer()
        old = base.weight
        new = bnb.nn.Int8Params(weight.to(torch.float16).to("cpu"), requires_grad=False, has_fp16_weights=False)
        base.weight = new.to(old.device)
        base.state.reset_grads()
        base.state.SCB = base.weight.SCB


# ---- PEFT dispatch ---------------------------------------------------------------------------------------------------
def _base_of(target: nn.Module) -> nn.Module:
    return target.get_base_layer() if isinstance(target, BaseTunerLayer) else target


def is_quantized_4bit(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit``."""
    return isinstance(module, bnb.nn.Linear4bit)


def is_quantized_8bit(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear8bitLt`` holding int8 weights (not fp16 ones)."""
    return isinstance(module, bnb.nn.Linear8bitLt) and not module.state.has_fp16_weights


def dispatch_bnb_4bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[FastLoraLinear4bit]:
    """PEFT dispatcher: a [`FastLoraLinear4bit`] for a ``bnb.nn.Linear4bit`` target, else ``None``."""
    if is_quantized_4bit(_base_of(target)):
        return FastLoraLinear4bit(target, adapter_name, config=config, **kwargs)
    return None


def dispatch_bnb_8bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[FastLoraLinear8bit]:
    """PEFT dispatcher: a [`FastLoraLinear8bit`] for a quantized ``bnb.nn.Linear8bitLt`` target, else ``None``.

    An 8-bit layer that still keeps fp16 weights (``has_fp16_weights=True``) is not quantized; PEFT's own layer
    handles it.
    """
    if is_quantized_8bit(_base_of(target)):
        return FastLoraLinear8bit(target, adapter_name, config=config, **kwargs)
    return None


DISPATCHERS = (dispatch_bnb_4bit, dispatch_bnb_8bit)
