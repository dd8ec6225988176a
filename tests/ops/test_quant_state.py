"""``ops/quant_state.py``: the containers' flattening for the custom ops, and the per-weight memo."""

import dataclasses

import pytest
import torch

from peft_fastlora.ops.quant_state import Int8Rowwise, Packed4bit, memo, weight_from_fields
from peft_fastlora.ops.reference import dequantize_ref

from .helpers import make_weight


@pytest.mark.parametrize("kind", ["nf4", "nf4-nested", "fp4-128-bf16storage", "int8"])
def test_fields_round_trip(kind):
    weight = make_weight(kind, 24, 130, device="cpu")
    tensors, meta, quant_type = weight.to_fields()
    assert all(isinstance(t, torch.Tensor) for t in tensors) and meta[:2] == [24, 130]
    rebuilt = weight_from_fields(tensors, meta, quant_type)
    assert type(rebuilt) is type(weight) and rebuilt == weight
    assert quant_type == ("int8" if isinstance(weight, Int8Rowwise) else kind[:3])
    assert torch.equal(dequantize_ref(rebuilt, torch.float32), dequantize_ref(weight, torch.float32))


def test_memo_is_per_container_key_and_storage():
    weight = make_weight("nf4-nested", 8, 64, device="cpu")
    builds = []

    def build():
        builds.append(1)
        return len(builds)

    assert memo(weight, ("a",), build) == memo(weight, ("a",), build) == 1
    assert memo(weight, ("b",), build) == 2  # another key
    assert memo(dataclasses.replace(weight), ("a",), build) == 3  # another container: its own memo
    weight.data.data = weight.data.clone()  # a storage swapped in place
    assert memo(weight, ("a",), build) == 4
    assert isinstance(weight, Packed4bit) and "_memo" not in repr(weight)
