"""``ops/reference.py``, the CPU production path: bit-exact with the literal oracle and with bitsandbytes' own
pure-torch dequantization, on awkward shapes and every format option."""

import bitsandbytes.functional as bnbF
import pytest
import torch
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

from peft_fastlora.ops.quant_state import Packed4bit
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

from .helpers import dequantize_oracle, make_inputs, make_weight, quantize

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# bitsandbytes' documented pure-torch twin of its CUDA kernel, without its torch.compile wrapper.
_bnb_dequant_4bit_torch = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)

# numel not a multiple of the blocksize, odd numel, a single row, several nested-absmax blocks (130x260 / 64 = 529
# absmax codes = 3 nested blocks of 256), big blocksizes, every storage dtype (non-uint8 storage needs numel % 8 == 0).
CASES = [
    ("nf4-nested", (33, 70)), ("fp4-bf16storage", (96, 80)), ("nf4-128-fp16storage", (96, 80)),
    ("fp4-128-nested-fp32storage", (64, 24)), ("nf4-256-nested", (1, 130)), ("nf4-4096-nested-fp16storage", (7, 1000)),
    ("fp4-nested", (5, 33)), ("nf4-nested-bf16storage", (130, 260)), ("int8", (37, 75)), ("int8", (1, 130)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", CASES, ids=str)
def test_matches_the_oracle_and_bitsandbytes(kind, shape, dtype):
    weight, q, state = quantize(torch.randn(shape), kind)
    out = dequantize_ref(weight, dtype)
    assert out.shape == shape and out.dtype == dtype
    assert torch.equal(out, dequantize_oracle(weight, dtype))
    if kind == "int8":
        assert torch.equal(out, bnbF.int8_vectorwise_dequant(weight.cb, weight.scb).to(dtype))
        return
    absmax = state.absmax
    if state.nested:
        absmax = bnbF.dequantize_blockwise(state.absmax, state.state2) + state.offset
    flat = q.reshape(-1).view(torch.uint8)
    expected = _bnb_dequant_4bit_torch(flat, absmax.float(), state.code, state.blocksize, list(state.shape), dtype)
    assert torch.equal(out, expected)


def test_absmax_of_any_shape_is_read_flat():
    """bitsandbytes' CPU inference packing leaves absmax 2-D; the reference must read it in storage order."""
    weight = make_weight("nf4", 16, 128, device="cpu")
    reshaped = Packed4bit(**{**_fields(weight), "absmax": weight.absmax.view(4, -1)})
    assert torch.equal(dequantize_ref(reshaped, torch.float32), dequantize_oracle(weight, torch.float32))


def test_lora_linear_ref_is_the_formula():
    weight = make_weight("nf4-nested", 24, 64, device="cpu")
    x, bias, a, b, lx = make_inputs((2, 3), 24, 64, torch.float32, lora_x=True, device="cpu")
    w = dequantize_oracle(weight, torch.float32)
    expected = x @ w.T + bias + 0.5 * (lx @ a.T) @ b.T
    torch.testing.assert_close(lora_linear_ref(x, weight, bias, a, b, 0.5, lx), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora_linear_ref(x, weight, None, None, None, 1.0), x @ w.T, atol=1e-5, rtol=1e-5)


def _fields(weight: Packed4bit) -> dict:
    names = ("data", "absmax", "code", "blocksize", "shape", "nested_absmax", "nested_code", "nested_blocksize",
             "offset", "quant_type")  # fmt: skip
    return {name: getattr(weight, name) for name in names}
