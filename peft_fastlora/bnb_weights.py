"""Turns bitsandbytes parameters into the plain-tensor containers that ``peft_fastlora.ops`` works on."""

from __future__ import annotations

import torch

from .ops.quant_state import Int8Rowwise, Packed4bit


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


def int8_from_bnb(weight) -> Int8Rowwise:
    """Builds an [`Int8Rowwise`] from a bitsandbytes ``Int8Params`` (data holds CB, ``weight.SCB`` the row scales)."""
    scb = getattr(weight, "SCB", None)
    if scb is None:
        raise ValueError(
            "This 8-bit weight has no `SCB` row scales: it was never quantized (bitsandbytes quantizes an Int8Params "
            "when it is moved to a device). Load the model with `BitsAndBytesConfig(load_in_8bit=True)` first."
        )
    cb = weight.CB if getattr(weight, "CB", None) is not None else weight.data
    return Int8Rowwise(cb=cb, scb=scb)
