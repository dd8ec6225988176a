"""``ops/kernels/rms_norm.py`` and ``ops/rms_norm.py`` (RMSNorm rows, "llama" casting): the kernels against their
torch twins, the twins against transformers' own Llama norm and its autograd, the weight's gradient, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_fastlora.ops import RMSNormFunction, kernels, rms_norm
from peft_fastlora.ops.reference import rms_norm_backward_ref, rms_norm_ref
from peft_fastlora.ops.rms_norm import supports as rms_norm_supports

from .helpers import DEVICE

CASES = [  # (dtype, atol, rtol) on O(1) outputs: fp32 math in both; the sum of squares' order may move rstd one ulp,
    # which moves a rounded output by at most one ulp of its dtype
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1.6e-2, 1.6e-2, id="bf16"),
]
SHAPES = [(1, 1), (3, 5), (2, 7, 96), (4, 130), (9, 1000)]  # (..., n): widths off a power of two, one-element rows


def _operands(shape, dtype, weight_dtype=None, device=DEVICE):
    x = (torch.randn(*shape, device=device) * 3 + 0.5).to(dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], device=device)).to(weight_dtype or dtype)
    grad = torch.randn(*shape, device=device).to(dtype)
    return x, weight, grad


@pytest.fixture
def norm_kernels(force_triton):
    return kernels.load().rms_norm


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_kernels_match_their_twins(norm_kernels, shape, offset, dtype, atol, rtol):
    x, weight, grad = _operands(shape, dtype, torch.float32 if dtype != torch.float32 else None)
    eps = 1e-6
    y = norm_kernels.rms_norm_forward(x, weight, eps, offset)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, rms_norm_ref(x, weight, eps, offset), atol=atol, rtol=rtol)
    dx = norm_kernels.rms_norm_backward(grad, x, weight, eps, offset)
    assert dx.shape == x.shape and dx.dtype == dtype
    expected = rms_norm_backward_ref(grad, x, weight, eps, offset)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(dx, expected, atol=atol * scale, rtol=rtol)


def test_kernels_read_a_non_contiguous_input(norm_kernels):
    x, weight, grad = _operands((6, 40), torch.float32)
    wide = torch.randn(6, 80)
    wide[:, ::2] = x
    view = wide[:, ::2]
    torch.testing.assert_close(norm_kernels.rms_norm_forward(view, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    torch.testing.assert_close(norm_kernels.rms_norm_backward(grad, view, weight, 1e-5),
                               rms_norm_backward_ref(grad, x, weight, 1e-5))  # fmt: skip


@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_twins_match_transformers_llama_norm_and_its_autograd(reference_path, dtype, atol, rtol):
    x, weight, grad = _operands((5, 64), dtype)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    x_hf = x.clone().requires_grad_()
    y_hf = norm(x_hf)
    y_hf.backward(grad)
    # transformers rounds x * rstd to x's dtype and multiplies by the weight in it: the twin's one rounding each
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5), y_hf.detach(), atol=atol, rtol=rtol)
    scale = x_hf.grad.float().abs().max().item()
    # autograd's backward rounds its intermediates to the dtype, the twin keeps them in fp32
    torch.testing.assert_close(rms_norm_backward_ref(grad, x, weight, 1e-5), x_hf.grad, atol=4 * atol * scale,
                               rtol=4 * rtol)  # fmt: skip


def test_backward_twin_is_the_gradient_of_exact_math(reference_path):
    x, weight, grad = _operands((4, 33), torch.float64)
    x64 = x.clone().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight + 0.5)
    y.backward(grad)
    got = rms_norm_backward_ref(grad, x, weight, 1e-6, 0.5)  # fp32 math on fp64 inputs: fp32's precision
    torch.testing.assert_close(got, x64.grad, atol=1e-6 * x64.grad.abs().max().item(), rtol=2e-5)


@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_function_gives_input_and_weight_grads(reference_path, dtype, atol, rtol):
    x, weight, grad = _operands((3, 4, 24), dtype, torch.float32)
    x_ours, w_ours = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rms_norm(x_ours, w_ours, 1e-6)
    assert type(out.grad_fn).__name__ == "RMSNormFunctionBackward"
    out.backward(grad)
    torch.testing.assert_close(x_ours.grad, rms_norm_backward_ref(grad, x, weight, 1e-6), atol=0, rtol=0)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    expected_dw = (grad.double() * normed.double()).reshape(-1, 24).sum(0)
    torch.testing.assert_close(w_ours.grad.double(), expected_dw, atol=atol * 12, rtol=rtol)
    assert w_ours.grad.dtype == torch.float32
    frozen = rms_norm(x.clone().requires_grad_(), weight, 1e-6)
    assert RMSNormFunction is type(frozen.grad_fn)._forward_cls


@pytest.mark.parametrize("weight_shape, x_shape", [((8,), (2, 9)), ((2, 8), (2, 8))], ids=["width", "2-d weight"])
def test_bad_weight_is_refused_by_name(weight_shape, x_shape):
    with pytest.raises(ValueError, match="`weight`"):
        rms_norm(torch.randn(*x_shape), torch.ones(*weight_shape), 1e-6)


def test_rows_wider_than_a_program_are_refused_on_the_triton_path(force_triton):
    x, weight = torch.randn(2, 40000), torch.ones(40000)
    assert not rms_norm_supports(x, weight)
    with pytest.raises(ValueError, match="32768 wide"):
        rms_norm(x, weight, 1e-6)


def test_integer_rows_are_refused(reference_path):
    assert not rms_norm_supports(torch.ones(2, 8, dtype=torch.int32), torch.ones(8))
    with pytest.raises(ValueError, match="`x` and `weight`"):
        rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096), (37, 4100), (2, 2048, 3584)], ids=str)
@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_gpu_kernels_match_their_twins(shape, dtype, atol, rtol):
    x, weight, grad = _operands(shape, dtype, device="cuda")
    rows = kernels.load().rms_norm
    torch.testing.assert_close(rows.rms_norm_forward(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=atol,
                               rtol=rtol)  # fmt: skip
    expected = rms_norm_backward_ref(grad, x, weight, 1e-5)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(rows.rms_norm_backward(grad, x, weight, 1e-5), expected, atol=atol * scale, rtol=rtol)
