"""``ops/kernels/dequant.py``: the Triton dequantization vs the pure-torch reference and bitsandbytes' own: bit-exact.

On CPU the kernels run under the Triton interpreter, so that run takes a covering subset of the cases; the full
product and real model shapes are ``@pytest.mark.gpu``.
"""

import dataclasses
import itertools
import os

import bitsandbytes.functional as bnbF
import pytest
import torch
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

from peft_fastlora.ops.quant_state import Int8Rowwise, Packed4bit
from peft_fastlora.ops.reference import dequantize_4bit_ref, dequantize_int8_ref, dequantize_window_ref

from .helpers import DEVICE, dequantize_oracle, quantize

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    from peft_fastlora.ops.kernels.dequant import (
        column_alignment,
        dequantize_4bit,
        dequantize_int8,
        dequantize_triton,
        dequantize_window,
    )
else:
    pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)

OUT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
STORAGES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32]

# bitsandbytes' documented pure-torch twin of its CUDA kernel, without its torch.compile wrapper (seconds per shape).
_bnb_dequant_4bit_torch = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)


def make_4bit(shape, quant_type="nf4", nested=False, blocksize=64, storage=torch.uint8, w_dtype=torch.float32):
    """Quantizes a fresh random weight with bitsandbytes; returns (Packed4bit, packed data, QuantState)."""
    storage_name = {torch.bfloat16: "-bf16storage", torch.float16: "-fp16storage", torch.float32: "-fp32storage"}
    kind = f"{quant_type}-{blocksize}{'-nested' if nested else ''}{storage_name.get(storage, '')}"
    return quantize(torch.randn(shape, device=DEVICE, dtype=w_dtype), kind)


def bnb_dequant_torch(q, st, dtype):
    """bitsandbytes' own pure-torch dequantization (what its CUDA kernel computes), for any device."""
    absmax = st.absmax
    if st.nested:
        absmax = bnbF.dequantize_blockwise(st.absmax, st.state2) + st.offset
    flat = q.reshape(-1).view(torch.uint8)
    return _bnb_dequant_4bit_torch(flat, absmax.float(), st.code, st.blocksize, list(st.shape), dtype)


def assert_4bit_exact(weight, q, st, dtype):
    out = dequantize_4bit(weight, dtype)
    assert out.shape == weight.shape and out.dtype == dtype and out.device == weight.device
    assert torch.equal(out, dequantize_4bit_ref(weight, dtype)), "differs from dequantize_4bit_ref"
    assert torch.equal(out, bnb_dequant_torch(q, st, dtype)), "differs from bitsandbytes' dequantization"


# (quant_type, nested, blocksize, quant_storage, shape): every option at least twice, awkward shapes (numel not a
# multiple of the blocksize, odd numel, a single row), and a nested case with several nested-absmax blocks (130x260
# with blocksize 64 has 529 absmax codes, i.e. 3 blocks of 256). Non-uint8 storage needs numel % 8 == 0 in bnb.
CPU_CASES = [
    ("nf4", True, 64, torch.uint8, (33, 70)),
    ("fp4", False, 64, torch.bfloat16, (96, 80)),
    ("nf4", False, 128, torch.float16, (96, 80)),
    ("fp4", True, 128, torch.float32, (64, 24)),
    ("nf4", True, 256, torch.uint8, (1, 130)),
    ("fp4", False, 256, torch.bfloat16, (40, 100)),
    ("nf4", True, 4096, torch.float16, (7, 1000)),
    ("fp4", True, 64, torch.uint8, (5, 33)),
    ("fp4", True, 1024, torch.float32, (16, 520)),
    ("nf4", True, 64, torch.bfloat16, (130, 260)),
]


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("quant_type,nested,blocksize,storage,shape", CPU_CASES, ids=str)
def test_dequantize_4bit_bit_exact(quant_type, nested, blocksize, storage, shape, dtype):
    weight, q, st = make_4bit(shape, quant_type, nested, blocksize, storage)
    assert_4bit_exact(weight, q, st, dtype)


# (block_bytes, num_warps): blocks smaller than, equal to and larger than an absmax block (blocksize 64 = 32 bytes).
TILINGS = [(16, 1), (64, 2), (512, 4)]


@pytest.mark.parametrize("block_bytes,num_warps", TILINGS if DEVICE == "cpu" else [(1024, 8), (2048, 4), (4096, 4)])
@pytest.mark.parametrize("quant_type,nested,blocksize,storage,shape", [CPU_CASES[0], CPU_CASES[5]], ids=str)
def test_every_tiling_is_bit_exact(quant_type, nested, blocksize, storage, shape, block_bytes, num_warps):
    """The tilings the benchmark sweep may pick as defaults (odd sizes: masked tails)."""
    weight, q, st = make_4bit(shape, quant_type, nested, blocksize, storage)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.full(weight.shape, float("nan"), dtype=dtype, device=DEVICE)
        assert dequantize_4bit(weight, dtype, out, block_bytes=block_bytes, num_warps=num_warps) is out
        assert torch.equal(out, dequantize_oracle(weight, dtype))


def test_launch_args_are_memoized_per_container_and_dtype(monkeypatch):
    """The second call with the same container and dtype reuses its launch arguments; a new container builds its own,
    and a storage swapped in place is seen."""
    from peft_fastlora.ops.kernels import dequant as dequant_module

    calls = []
    real = dequant_module._args_4bit
    monkeypatch.setattr(dequant_module, "_args_4bit", lambda *a: calls.append(a[1]) or real(*a))
    weight, _, _ = make_4bit((8, 64), nested=True)
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16):
        assert torch.equal(dequantize_4bit(weight, dtype), dequantize_4bit_ref(weight, dtype))
    assert calls == [torch.bfloat16, torch.float16]
    assert torch.equal(dequantize_4bit(_replace(weight), torch.float16), dequantize_4bit_ref(weight, torch.float16))
    assert len(calls) == 3
    weight.data.data = weight.data.clone()  # new storage, same container
    assert torch.equal(dequantize_4bit(weight, torch.bfloat16), dequantize_4bit_ref(weight, torch.bfloat16))
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 75), (1, 130), (3, 4100)], ids=str)
def test_dequantize_int8_bit_exact(shape, dtype):
    w = torch.randn(shape, device=DEVICE, dtype=torch.float16)
    cb, scb, _ = bnbF.int8_vectorwise_quant(w)
    weight = Int8Rowwise(cb=cb, scb=scb)
    out = dequantize_int8(weight, dtype)
    assert out.shape == shape and out.dtype == dtype
    assert torch.equal(out, dequantize_int8_ref(weight, dtype))
    assert torch.equal(out, bnbF.int8_vectorwise_dequant(cb, scb).to(dtype))


def test_dequantize_triton_dispatches_on_weight_type():
    weight, _, _ = make_4bit((8, 64), nested=True)
    assert torch.equal(dequantize_triton(weight, torch.bfloat16), dequantize_4bit_ref(weight, torch.bfloat16))
    cb, scb, _ = bnbF.int8_vectorwise_quant(torch.randn(8, 64, device=DEVICE, dtype=torch.float16))
    int8 = Int8Rowwise(cb=cb, scb=scb)
    assert torch.equal(dequantize_triton(int8, torch.float16), dequantize_int8_ref(int8, torch.float16))


def test_out_argument_is_filled_and_returned():
    weight, _, _ = make_4bit((24, 40), nested=True)
    out = torch.full(weight.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    result = dequantize_4bit(weight, torch.bfloat16, out=out)
    assert result is out
    assert torch.equal(out, dequantize_4bit_ref(weight, torch.bfloat16))

    cb, scb, _ = bnbF.int8_vectorwise_quant(torch.randn(6, 10, device=DEVICE, dtype=torch.float16))
    int8 = Int8Rowwise(cb=cb, scb=scb)
    out8 = torch.empty(6, 10, dtype=torch.float32, device=DEVICE)
    assert dequantize_int8(int8, torch.float32, out=out8) is out8
    assert torch.equal(out8, dequantize_int8_ref(int8, torch.float32))


# (kind, shape, windows as (rows, columns)): blocksizes 64/128 and double quantization; windows at the start, the
# middle and the end of both dimensions, one block wide, odd numbers of rows; int8 takes any window.
WINDOW_CASES = [
    ("nf4-64-nested", (7, 256), [((0, 7), (0, 64)), ((0, 7), (64, 192)), ((2, 5), (192, 256)), ((3, 7), (0, 256))]),
    ("fp4-64", (12, 192), [((0, 12), (64, 128)), ((11, 12), (128, 192)), ((0, 5), (0, 192))]),
    ("nf4-128-nested-bf16storage", (16, 384), [((0, 16), (128, 384)), ((5, 16), (0, 128))]),
    ("int8", (9, 70), [((0, 9), (0, 1)), ((2, 9), (3, 40)), ((0, 4), (33, 70)), ((8, 9), (0, 70))]),
]


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape,windows", WINDOW_CASES, ids=lambda v: str(v)[:24])
def test_windows_are_bit_exact(kind, shape, windows, dtype):
    """A window is the same bits as that part of the whole weight (reference, literal oracle and bitsandbytes)."""
    weight, q, st = quantize(torch.randn(shape, device=DEVICE), kind)
    whole = dequantize_oracle(weight, dtype)
    if q is not None:
        assert torch.equal(whole, bnb_dequant_torch(q, st, dtype))
    for rows, columns in windows:
        out = dequantize_window(weight, dtype, rows, columns)
        assert out.shape == (rows[1] - rows[0], columns[1] - columns[0]) and out.is_contiguous()
        assert out.dtype == dtype
        assert torch.equal(out, whole[rows[0] : rows[1], columns[0] : columns[1]]), (rows, columns)
        assert torch.equal(out, dequantize_window_ref(weight, dtype, rows, columns)), (rows, columns)


def test_window_alignment_and_refusals():
    nf4, _, _ = make_4bit((4, 128), blocksize=64)
    ragged, _, _ = make_4bit((4, 96), blocksize=64)  # rows of 1.5 blocks: no windows
    int8, _, _ = quantize(torch.randn(4, 10, device=DEVICE), "int8")
    assert (column_alignment(nf4), column_alignment(ragged), column_alignment(int8)) == (64, 0, 1)
    whole = dequantize_window(nf4, torch.float32, (0, 4), (0, 128))
    assert torch.equal(whole, dequantize_4bit_ref(nf4, torch.float32))
    bad = [(nf4, (0, 4), (32, 128)), (nf4, (0, 4), (0, 100)), (nf4, (0, 4), (64, 64)), (nf4, (0, 4), (0, 192)),
           (nf4, (2, 2), (0, 64)), (nf4, (0, 5), (0, 64)), (ragged, (0, 4), (0, 64)),
           (int8, (0, 4), (-1, 4))]  # fmt: skip
    for weight, rows, columns in bad:
        with pytest.raises(ValueError, match=r"`rows`, `columns` = \(" + str(rows[0])):
            dequantize_window(weight, torch.float32, rows, columns)


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape,windows", WINDOW_CASES, ids=lambda v: str(v)[:24])
def test_windows_into_strided_rows(kind, shape, windows, dtype):
    """A window (or the whole weight) written into the first columns of a wider matrix (the fused LoRA MLP puts the
    adapter factors in the others): the same bits, and the other columns untouched."""
    weight, _, _ = quantize(torch.randn(shape, device=DEVICE), kind)
    whole = dequantize_oracle(weight, dtype)
    for rows, columns in windows + [((0, shape[0]), (0, shape[1]))]:
        n, k = rows[1] - rows[0], columns[1] - columns[0]
        wide = torch.full((n, k + 24), float("nan"), dtype=dtype, device=DEVICE)
        out = dequantize_window(weight, dtype, rows, columns, out=wide[:, :k])
        assert out.data_ptr() == wide.data_ptr()
        assert torch.equal(wide[:, :k], whole[rows[0] : rows[1], columns[0] : columns[1]]), (rows, columns)
        assert wide[:, k:].isnan().all(), (rows, columns)


def test_strided_out_refusals():
    ragged, _, _ = make_4bit((4, 96), blocksize=64)  # rows of 1.5 blocks: a tile may straddle two output rows
    with pytest.raises(ValueError, match="whole absmax blocks"):
        dequantize_4bit(ragged, torch.float32, out=torch.empty(4, 128, device=DEVICE)[:, :96])
    nf4, _, _ = make_4bit((4, 128), blocksize=64)
    with pytest.raises(ValueError, match="unit column stride"):
        dequantize_4bit(nf4, torch.float32, out=torch.empty(128, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"`out` must be a \(4, 128\)"):
        dequantize_4bit(nf4, torch.float32, out=torch.empty(4, 64, device=DEVICE))


def _replace(weight: Packed4bit, **changes) -> Packed4bit:
    return dataclasses.replace(weight, **changes)


# ----------------------------------------------------------------------------------------------------- GPU only


def _gpu_cases():
    shapes = {torch.uint8: [(33, 70), (5, 33), (1, 130)], "any": [(96, 80), (130, 260), (256, 1000)]}
    for quant_type, nested, blocksize, storage in itertools.product(
        ["nf4", "fp4"], [False, True], [64, 128, 256, 512, 1024, 2048, 4096], STORAGES
    ):
        for shape in shapes["any"] + (shapes[torch.uint8] if storage == torch.uint8 else []):
            yield quant_type, nested, blocksize, storage, shape


@pytest.mark.gpu
@pytest.mark.parametrize("quant_type,nested,blocksize,storage,shape", list(_gpu_cases()), ids=str)
def test_gpu_full_product_bit_exact(quant_type, nested, blocksize, storage, shape):
    weight, q, st = make_4bit(shape, quant_type, nested, blocksize, storage)
    for dtype in OUT_DTYPES:
        assert_4bit_exact(weight, q, st, dtype)
        st.dtype = torch.float32  # bnb's CUDA kernel in fp32, rounded once by us: the same math as ours
        assert torch.equal(dequantize_4bit(weight, dtype), bnbF.dequantize_4bit(q, st).to(dtype))


REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("nf4", False), ("fp4", True)], ids=str)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=str)
def test_gpu_real_shapes_match_bitsandbytes_cuda(shape, quant_type, nested, w_dtype):
    weight, q, st = make_4bit(shape, quant_type, nested, 64, torch.uint8, w_dtype)
    st.dtype = torch.float32
    expected = bnbF.dequantize_4bit(q, st)
    for dtype in OUT_DTYPES:
        out = dequantize_4bit(weight, dtype)
        assert torch.equal(out, expected.to(dtype))
        assert torch.equal(out, dequantize_4bit_ref(weight, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4-64-nested", "int8"])
@pytest.mark.parametrize("shape,rows,columns", [
    ((4096, 14336), (0, 4096), (0, 7168)), ((4096, 14336), (0, 4096), (7168, 14336)),
    ((4096, 14336), (2048, 4096), (0, 14336)), ((14336, 4096), (0, 14336), (1024, 2048)),
    ((14336, 4096), (12288, 14336), (0, 4096)),
], ids=str)  # fmt: skip
def test_gpu_windows_of_real_shapes(kind, shape, rows, columns):
    weight, _, _ = quantize(torch.randn(shape, device="cuda"), kind)
    whole = dequantize_triton(weight, torch.bfloat16)
    part = whole[rows[0] : rows[1], columns[0] : columns[1]]
    assert torch.equal(dequantize_window(weight, torch.bfloat16, rows, columns), part)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (33, 70)], ids=str)
def test_gpu_int8_real_shapes(shape):
    cb, scb, _ = bnbF.int8_vectorwise_quant(torch.randn(shape, device="cuda", dtype=torch.float16))
    weight = Int8Rowwise(cb=cb, scb=scb)
    for dtype in OUT_DTYPES:
        assert torch.equal(dequantize_int8(weight, dtype), dequantize_int8_ref(weight, dtype))
        assert torch.equal(dequantize_int8(weight, dtype), bnbF.int8_vectorwise_dequant(cb, scb).to(dtype))


@pytest.mark.gpu
def test_gpu_launches_on_the_weights_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    weight, _, _ = make_4bit((64, 128), nested=True)
    moved = _replace(
        weight,
        **{
            f: getattr(weight, f).to("cuda:1")
            for f in ("data", "absmax", "code", "nested_absmax", "nested_code", "offset")
        },
    )
    with torch.cuda.device(0):
        out = dequantize_4bit(moved, torch.bfloat16)
    assert out.device == torch.device("cuda:1")
    assert torch.equal(out.cpu(), dequantize_4bit_ref(weight, torch.bfloat16).cpu())
