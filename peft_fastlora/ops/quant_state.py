"""Plain-tensor views of quantized weights, the only thing the kernels see.

The kernels never import bitsandbytes or peft: the backend files (``peft_fastlora/bnb.py``) turn a bitsandbytes
parameter into one of these containers, and every op here takes them. All tensors live on the weight's device.

A container crosses a ``torch.library`` custom-op boundary as its fields (custom ops take only tensors, ints and
strings): ``weight.to_fields()`` gives ``(tensors, meta, quant_type)`` and [`weight_from_fields`] rebuilds it, like
``__tensor_flatten__``/``__tensor_unflatten__`` of a tensor subclass. ``meta`` always starts with
``(out_features, in_features)``, so a fake (meta) implementation reads the shape without rebuilding the container.

Caching: the containers are the one place where ops/ memoizes per-weight work (see [`memo`]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, TypeVar

import torch

# Activation, adapter and output dtypes every op accepts.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# bitsandbytes divides by 127 as a multiply by this fp32 reciprocal; using the same constant keeps us bit-exact.
INT8_INV_127 = 7.874015718698502e-3

T = TypeVar("T")


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
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def nested(self) -> bool:
        return self.nested_code is not None

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def storage_key(self) -> tuple[int, int]:
        """Data pointers of the codes and scales: a storage swapped in place (``t.data = ...``) changes the key."""
        return self.data.data_ptr(), self.absmax.data_ptr()

    def to_fields(self) -> tuple[list[torch.Tensor], list[int], str]:
        """``([data, absmax, code] (+ [nested_absmax, nested_code, offset] when double-quantized),
        [out, in, blocksize, nested_blocksize], quant_type)``; the inverse is [`weight_from_fields`]."""
        tensors = [self.data, self.absmax, self.code]
        if self.nested:
            tensors += [self.nested_absmax, self.nested_code, self.offset]
        return tensors, [*self.shape, self.blocksize, self.nested_blocksize], self.quant_type

    @classmethod
    def from_fields(cls, tensors: list[torch.Tensor], meta: list[int], quant_type: str) -> Packed4bit:
        data, absmax, code, *nested = tensors
        nested_absmax, nested_code, offset = nested or (None, None, None)
        out_features, in_features, blocksize, nested_blocksize = meta
        return cls(data=data, absmax=absmax, code=code, blocksize=int(blocksize),
                   shape=(int(out_features), int(in_features)), nested_absmax=nested_absmax, nested_code=nested_code,
                   nested_blocksize=int(nested_blocksize), offset=offset, quant_type=quant_type)  # fmt: skip


@dataclass(frozen=True)
class Int8Rowwise:
    """An 8-bit weight with one scale per output row: ``W = cb * scb[:, None] / 127``.

    Args:
        cb (`torch.Tensor`): int8 codes of shape ``(out_features, in_features)``.
        scb (`torch.Tensor`): fp32 per-row absmax of shape ``(out_features,)``.
    """

    cb: torch.Tensor
    scb: torch.Tensor
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    quant_type = "int8"  # a class constant, not a field: what `to_fields` names the kind

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.cb.shape)

    @property
    def device(self) -> torch.device:
        return self.cb.device

    def storage_key(self) -> tuple[int, int]:
        """Data pointers of the codes and scales: a storage swapped in place (``t.data = ...``) changes the key."""
        return self.cb.data_ptr(), self.scb.data_ptr()

    def to_fields(self) -> tuple[list[torch.Tensor], list[int], str]:
        """``([cb, scb], [out, in], "int8")``; the inverse is [`weight_from_fields`]."""
        return [self.cb, self.scb], [*self.shape], self.quant_type

    @classmethod
    def from_fields(cls, tensors: list[torch.Tensor], meta: list[int], quant_type: str) -> Int8Rowwise:
        cb, scb = tensors
        return cls(cb=cb, scb=scb)


QuantizedWeight = Packed4bit | Int8Rowwise


def weight_from_fields(tensors: list[torch.Tensor], meta: list[int], quant_type: str) -> QuantizedWeight:
    """Rebuilds the container that ``weight.to_fields()`` flattened."""
    cls = Int8Rowwise if quant_type == Int8Rowwise.quant_type else Packed4bit
    return cls.from_fields(tensors, meta, quant_type)


def memo(weight: QuantizedWeight, key: tuple, build: Callable[[], T]) -> T:
    """``build()``, memoized on the container under ``key`` plus the container's storage pointers.

    The one per-weight cache of ops/. What is cached: work that depends only on the container's fields and on
    ``key`` (the argument validation, the kernels' launch arguments per output dtype or tiling). Keyed by: ``key``
    (which names its user and holds every other input, e.g. the dtype) and ``weight.storage_key()``, so a storage
    swapped in place is seen. Invalidated: never; it lives and dies with the container, which the layer rebuilds
    when the weight's storage or quantization state changes. Containers rebuilt on every call (inside the custom
    ops under ``torch.compile``) simply miss it.
    """
    full_key = (key, weight.storage_key())
    value = weight._memo.get(full_key)
    if value is None:
        value = weight._memo[full_key] = build()
    return value
