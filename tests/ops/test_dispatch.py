"""``ops/dispatch.py``, the one door: which implementation runs, autocast, and the one argument check.

CPU tensors take the reference path unless ``PEFT_FASTLORA_FORCE_TRITON=1`` (the ``force_triton`` fixture), which runs
the Triton paths under the interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peft_fastlora.ops import LoraLinearFunction, dequantize, dispatch, fastlora_linear, kernels
from peft_fastlora.ops.quant_state import Int8Rowwise, weight_from_fields
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

from .helpers import assert_close_scaled, make_inputs, make_weight

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Tolerances (relative to the output magnitude) for the worst of x/adapter dtypes in a comparison to fp32.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


@pytest.fixture(params=["reference", "triton"])
def path(request):
    request.getfixturevalue("force_triton" if request.param == "triton" else "reference_path")
    return request.param


def inputs(lead, n, k, x_dtype, adapter_dtype, **kwargs):
    x, bias, lora_a, lora_b, _ = make_inputs(lead, n, k, x_dtype, adapter_dtype, device="cpu", requires_grad=True,
                                             **kwargs)  # fmt: skip
    return x, bias, lora_a, lora_b


def _spy(monkeypatch, owner, name):
    """Replaces ``owner.name`` with a wrapper that records whether autocast was on at each call."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


# ---- which implementation runs ---------------------------------------------------------------------------------------
def test_cpu_runs_reference(monkeypatch, path):
    weight = make_weight("nf4-nested", 40, 100, device="cpu")
    x, bias, lora_a, lora_b = inputs((2, 9), 40, 100, torch.bfloat16, torch.float32)
    ref_calls = _spy(monkeypatch, dispatch, "lora_linear_ref")
    y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    is_function = "LoraLinearFunction" in y.grad_fn.name()
    assert is_function == (path == "triton") and len(ref_calls) == (path == "reference")
    if path == "reference":  # the reference path is exactly lora_linear_ref
        assert torch.equal(y, lora_linear_ref(x, weight, bias, lora_a, lora_b, 2.0))


def test_small_m_without_grad_runs_fused_kernel(monkeypatch, force_triton):
    small_m = kernels.load().small_m
    weight = make_weight("nf4", 40, 100, device="cpu")
    m_max = small_m.small_m_limit(weight, torch.device("cpu"))
    assert m_max == small_m.SMALL_M_MAX  # no table off CUDA
    calls = []
    real = small_m.small_m_linear
    monkeypatch.setattr(small_m, "small_m_linear", lambda x, *args: calls.append(x.shape) or real(x, *args))
    x, bias, lora_a, lora_b = inputs((m_max,), 40, 100, torch.float16, torch.float16)
    with torch.no_grad():
        y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
        assert len(calls) == 1 and y.dtype == torch.float16
        y_ref = lora_linear_ref(x.float(), weight, bias.float(), lora_a.float(), lora_b.float(), 2.0)
        assert_close_scaled(y, y_ref, 5e-3, 5e-3)
        x_big = torch.randn(m_max + 1, 100, dtype=torch.float16)
        fastlora_linear(x_big, weight, bias, lora_a, lora_b, 2.0)  # too many rows for the decode kernel
    y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)  # needs grad -> the autograd Function
    assert len(calls) == 1 and "LoraLinearFunction" in y.grad_fn.name()
    for t in (x, lora_a, lora_b):
        t.requires_grad_(False)
    fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)  # grad mode on but nothing requires grad
    assert len(calls) == 2


@pytest.mark.parametrize("adapter_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_output_dtype_is_x_dtype(path, x_dtype, adapter_dtype):
    weight = make_weight("nf4-nested", 48, 96, device="cpu")
    x, bias, lora_a, lora_b = inputs((2, 5), 48, 96, x_dtype, adapter_dtype)
    y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    assert y.dtype == x_dtype
    y.float().sum().backward()
    assert x.grad.dtype == x_dtype and lora_a.grad.dtype == adapter_dtype and lora_b.grad.dtype == adapter_dtype
    tol = max(TOL[x_dtype], TOL[adapter_dtype])
    y_ref = lora_linear_ref(x.float(), weight, bias.float(), lora_a.float(), lora_b.float(), 2.0)
    assert_close_scaled(y, y_ref, tol, tol)
    with torch.no_grad():  # the no-grad small-M path on the Triton side
        y = fastlora_linear(x[0, :2], weight, bias, lora_a, lora_b, 2.0)
    assert y.dtype == x_dtype
    assert_close_scaled(y, y_ref[0, :2], tol, tol)


def test_lora_x_same_tensor_as_x(path):
    weight = make_weight("int8", 40, 100, device="cpu")
    x, bias, lora_a, lora_b = inputs((7,), 40, 100, torch.float32, torch.float32)
    y1 = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    (g1,) = torch.autograd.grad(y1.sum(), x)
    y2 = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0, lora_x=x)
    (g2,) = torch.autograd.grad(y2.sum(), x)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_autocast_casts_x_and_runs_without_autocast(monkeypatch, path, x_dtype):
    weight = make_weight("nf4-nested", 40, 100, device="cpu")
    x, bias, lora_a, lora_b = inputs((3, 4), 40, 100, x_dtype, torch.float32)
    lora_x = (x * 0.5).detach().requires_grad_()
    if path == "reference":
        calls = _spy(monkeypatch, dispatch, "lora_linear_ref")
    else:
        calls = _spy(monkeypatch, LoraLinearFunction, "apply")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0, lora_x)
    assert calls == [False], "the implementation must run with autocast disabled"
    assert y.dtype == torch.bfloat16
    expected = fastlora_linear(x.bfloat16(), weight, bias, lora_a, lora_b, 2.0, lora_x.bfloat16())
    assert torch.equal(y, expected)
    y.float().sum().backward()
    assert x.grad.dtype == x_dtype and lora_x.grad.dtype == x_dtype and lora_a.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["nf4-nested", "fp4-bf16storage", "int8"])
def test_dequantize_dispatch(path, kind):
    weight = make_weight(kind, 40, 104, device="cpu")
    for dtype in FLOAT_DTYPES:
        assert torch.equal(dequantize(weight, dtype), dequantize_ref(weight, dtype))
        out = torch.full(weight.shape, float("nan"), dtype=dtype)
        assert dequantize(weight, dtype, out=out) is out and torch.equal(out, dequantize_ref(weight, dtype))


# ---- the one argument check ------------------------------------------------------------------------------------------
def test_weight_is_checked_once_per_container(monkeypatch, force_triton):
    calls = []
    real = dispatch._check_packed4bit
    monkeypatch.setattr(dispatch, "_check_packed4bit", lambda w: calls.append(w) or real(w))
    weight = make_weight("nf4-nested", 40, 100, device="cpu")
    x, bias, lora_a, lora_b = inputs((2,), 40, 100, torch.float32, torch.float32)
    for _ in range(3):
        fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
        dequantize(weight, torch.bfloat16)
    assert len(calls) == 1
    fastlora_linear(x, dataclasses.replace(weight), bias, lora_a, lora_b, 2.0)  # a new container is checked again
    assert len(calls) == 2


def _bad_linear_calls(weight, x, bias, a, b, lx):
    """(call arguments, exception, message) for every rule of `check_linear_args`."""
    tensors, meta, quant_type = weight.to_fields()
    meta_weight = weight_from_fields([t if t is None else t.to("meta") for t in tensors], meta, quant_type)
    return [
        ((x[:, :99], weight, bias, a, b, 1.0), ValueError, "in_features=100"),
        ((x.to(torch.int32), weight, bias, a, b, 1.0), TypeError, "`x.dtype` must be float16, bfloat16 or float32"),
        ((x, dequantize_ref(weight, torch.float32), bias, a, b, 1.0), TypeError, "Packed4bit or Int8Rowwise"),
        ((x, weight, bias[:-1], a, b, 1.0), ValueError, r"`bias` must have shape \(40,\)"),
        ((x, weight, bias.to("meta"), a, b, 1.0), ValueError, "`bias` is on meta but `x` is on cpu"),
        ((x, weight, bias, a, None, 1.0), ValueError, "`lora_a` and `lora_b` must be given together"),
        ((x, weight, bias, a, b[:-1], 1.0), ValueError, r"`lora_b` \(40, r\)"),
        ((x, weight, bias, a[:, :-1], b, 1.0), ValueError, r"`lora_a` must be \(r, 100\)"),
        ((x, weight, bias, a.double(), b, 1.0), TypeError, "`lora_a.dtype` must be"),
        ((x, weight, bias, a, b, 1.0, lx[:1]), ValueError, "`lora_x` must have the shape of `x`"),
        ((x, meta_weight, None, None, None, 1.0), ValueError, "`weight` is on meta but `x` is on cpu"),
    ]


def test_bad_linear_arguments_raise_the_same_error_on_every_path(monkeypatch):
    """One check at the door: the reference path, the training path and the decode path raise alike."""
    weight = make_weight("nf4-nested", 40, 100, device="cpu")
    x, bias, a, b, lx = make_inputs((3,), 40, 100, torch.float32, device="cpu", lora_x=True)
    for force in ("0", "1"):
        monkeypatch.setenv(dispatch.FORCE_TRITON_ENV, force)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                for args, error, message in _bad_linear_calls(weight, x.requires_grad_(grad), bias, a, b, lx):
                    with pytest.raises(error, match=message):
                        fastlora_linear(*args)


def _replace(weight, **changes):
    return dataclasses.replace(weight, **changes)


def test_bad_weights_and_dequantize_arguments_raise_clear_errors(path):
    weight = make_weight("nf4-nested", 8, 64, device="cpu")
    bad_weights = [
        (_replace(weight, data=weight.data.reshape(16, 16).t()), "`weight.data` must be contiguous"),
        (_replace(weight, shape=(8, 65)), "`weight.data` has 256 bytes but the weight needs at least 260"),
        (_replace(weight, blocksize=48), "`weight.blocksize` must be a power of two"),
        (_replace(weight, absmax=weight.absmax.float()), "`weight.absmax` must have dtype torch.uint8"),
        (_replace(weight, nested_code=weight.nested_code.to("meta")), "`weight.nested_code` is on meta"),
        (_replace(weight, code=weight.code[:8]), "`weight.code` has 8 elements"),
        (_replace(weight, nested_blocksize=0), "`weight.nested_blocksize` must be >= 1"),
    ]
    int8 = make_weight("int8", 6, 10, device="cpu")
    bad_weights += [
        (Int8Rowwise(cb=int8.cb, scb=int8.scb[:5]), "one scale per row"),
        (Int8Rowwise(cb=int8.cb.float(), scb=int8.scb), "`weight.cb` must have dtype torch.int8"),
        (Int8Rowwise(cb=int8.cb.t(), scb=int8.scb), "`weight.cb` must be contiguous"),
    ]
    for bad, message in bad_weights:
        with pytest.raises(ValueError, match=message):
            dequantize(bad, torch.float16)
        x = torch.randn(2, bad.shape[1])
        with pytest.raises(ValueError, match=message):
            fastlora_linear(x, bad, None, None, None, 1.0)
    with pytest.raises(TypeError, match="`dtype` must be float16, bfloat16 or float32"):
        dequantize(weight, torch.int8)
    with pytest.raises(TypeError, match="Packed4bit or Int8Rowwise"):
        dequantize(torch.zeros(2, 2), torch.float32)
    for out, message in [
        (torch.empty(8, 63, dtype=torch.bfloat16), r"`out` must be a \(8, 64\) torch.bfloat16"),
        (torch.empty(8, 64, dtype=torch.float16), r"`out` must be a \(8, 64\) torch.bfloat16"),
        (torch.empty(64, 8, dtype=torch.bfloat16).t(), "`out` must be contiguous"),
    ]:
        with pytest.raises(ValueError, match=message):
            dequantize(weight, torch.bfloat16, out=out)
