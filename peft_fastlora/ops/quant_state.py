"""Plain-tensor views of quantized weights, the only thing the kernels see.

The kernels never import bitsandbytes or peft: the backend files (``peft_fastlora/bnb.py``) turn a bitsandbytes
parameter into one of these containers, and every op here takes them. All tensors live on the weight's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Packed4bit:
    """A 4-bit (NF4 or FP4) blockwise-quantized weight of shape ``(out_features, in_features)``.

    Element ``i`` of the row-major flattened weight is stored in byte ``i // 2`` of ``data`` (high nibble for even
    ``i``, low nibble for odd ``i``) and decodes to ``code[nibble] * absmax[i // blocksize]``.

    Args:
        data (`torch.Tensor`): Packed codes in any storage dtype (uint8, bf16, fp16, fp32); read as raw bytes.
        absmax (`torch.Tensor`): Per-block scales, fp32 of shape ``(n_blocks,)``, or uint8 codes when double-quantized.
        code (`torch.Tensor`): The 16-entry fp32 lookup table (NF4 or FP4 values).
        blocksize (`int`): Elements per absmax block.
        shape (`tuple[int, int]`): ``(out_features, in_features)``.
        nested_absmax (`torch.Tensor`, *optional*): Double quantization: fp32 scales of the absmax codes.
        nested_code (`torch.Tensor`, *optional*): Double quantization: 256-entry fp32 table of the absmax codes.
        nested_blocksize (`int`): Double quantization: absmax codes per nested scale.
        offset (`torch.Tensor`, *optional*): Double quantization: fp32 scalar added to every decoded absmax.
        quant_type (`str`): ``"nf4"`` or ``"fp4"`` (informational; ``code`` carries the values).
    """

    data: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    blocksize: int
    shape: tuple[int, int]
    nested_absmax: Optional[torch.Tensor] = None
    nested_code: Optional[torch.Tensor] = None
    nested_blocksize: int = 0
    offset: Optional[torch.Tensor] = None
    quant_type: str = "nf4"

    @property
    def nested(self) -> bool:
        return self.nested_code is not None

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class Int8Rowwise:
    """An 8-bit weight with one scale per output row: ``W = cb * scb[:, None] / 127``.

    Args:
        cb (`torch.Tensor`): int8 codes of shape ``(out_features, in_features)``.
        scb (`torch.Tensor`): fp32 per-row absmax of shape ``(out_features,)``.
    """

    cb: torch.Tensor
    scb: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.cb.shape)

    @property
    def device(self) -> torch.device:
        return self.cb.device


QuantizedWeight = Packed4bit | Int8Rowwise
