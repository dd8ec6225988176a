"""``ops/kernels/lowrank.py`` (``out += scaling * a @ b.T`` in place) against its torch twin, the twin against fp64
math, and ``lora_linear.add_low_rank_``'s choice between the kernel and cuBLAS."""

from __future__ import annotations

import pytest
import torch

from peft_fastlora.ops import kernels
from peft_fastlora.ops.lora_linear import add_low_rank_
from peft_fastlora.ops.reference import lowrank_add_ref

from .helpers import DEVICE

CASES = [  # (dtype, atol, rtol): fp32 products and sum in both, one rounding; the sum's order may move one ulp
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1.6e-2, 1.6e-2, id="bf16"),
]
SHAPES = [(1, 1, 1), (70, 130, 16), (129, 257, 8), (64, 128, 64), (3, 300, 33), (200, 17, 5)]  # (M, N, r)


def _operands(m, n, r, dtype, device=DEVICE, b_transposed=False):
    out = torch.randn(m, n, device=device).to(dtype)
    a = torch.randn(m, r, device=device).to(dtype)
    b = (torch.randn(r, n, device=device) / r**0.5).to(dtype).t() if b_transposed else (
        torch.randn(n, r, device=device) / r**0.5).to(dtype)  # fmt: skip
    return out, a, b


@pytest.fixture
def lowrank(force_triton):
    return kernels.load().lowrank


@pytest.mark.parametrize("m, n, r", SHAPES, ids=str)
@pytest.mark.parametrize("b_transposed", [False, True], ids=["B", "A.T"])
@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_kernel_matches_its_twin(lowrank, m, n, r, b_transposed, dtype, atol, rtol):
    out, a, b = _operands(m, n, r, dtype, b_transposed=b_transposed)
    scaling = float(torch.empty(()).uniform_(0.5, 3.0))
    expected = lowrank_add_ref(out.clone(), a, b, scaling)
    before = out.clone()
    result = lowrank.lowrank_add_(out, a, b, scaling)
    assert result is out  # in place
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert not torch.equal(out, before)  # the update is not lost to rounding at these magnitudes


@pytest.mark.parametrize("dtype, atol, rtol", CASES)
def test_kernel_writes_columns_of_a_wider_matrix(lowrank, dtype, atol, rtol):
    wide = torch.randn(67, 300, device=DEVICE).to(dtype)
    before = wide.clone()
    view = wide[:, 40:190]  # rows 300 elements apart
    _, a, b = _operands(67, 150, 16, dtype)
    lowrank.lowrank_add_(view, a, b, 2.0)
    expected = lowrank_add_ref(before[:, 40:190].clone(), a, b, 2.0)
    torch.testing.assert_close(wide[:, 40:190].float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(wide[:, :40], before[:, :40]) and torch.equal(wide[:, 190:], before[:, 190:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_twin_is_one_rounding_of_exact_math(dtype):
    out, a, b = _operands(33, 45, 16, dtype)
    exact = out.double() + 1.7 * a.double() @ b.double().t()
    result = lowrank_add_ref(out.clone(), a, b, 1.7)
    assert result.dtype == dtype
    eps = torch.finfo(dtype).eps  # fp32 sums may land on the other side of a rounding boundary, by one ulp
    torch.testing.assert_close(result.double(), exact.to(dtype).double(), atol=eps, rtol=eps)


@pytest.mark.parametrize(
    "out_dtype, r, column_stride, field",
    [(torch.float32, 16, 1, "out .* torch.float32"), (torch.bfloat16, 65, 1, r"a \(8, 65\)"),
     (torch.bfloat16, 16, 2, r"strides \(64, 2\)")],
)
def test_kernel_refuses_layouts_it_does_not_handle(lowrank, out_dtype, r, column_stride, field):
    out = torch.randn(8, 32 * column_stride).to(out_dtype)[:, ::column_stride]
    a = torch.randn(8, r).to(out_dtype)
    b = torch.randn(32, r).to(out_dtype)
    assert not lowrank.supports(out, a)
    with pytest.raises(ValueError, match=field):
        lowrank.lowrank_add_(out, a, b, 1.0)


@pytest.mark.parametrize("dtype, r", [(torch.float32, 16), (torch.bfloat16, 80)], ids=["fp32", "r80"])
def test_add_low_rank_falls_back_to_cublas(force_triton, monkeypatch, dtype, r):
    lowrank = kernels.load().lowrank
    for name in ("lowrank_add_", "launch_lowrank_add_"):
        monkeypatch.setattr(lowrank, name, lambda *args: pytest.fail("the kernel was called"))
    out, a, b = _operands(24, 40, r, dtype)
    expected = out.clone().addmm_(a, b.t(), alpha=0.5)
    add_low_rank_(out, a, b, 0.5)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_add_low_rank_takes_the_kernel_for_16_bit(force_triton, monkeypatch):
    lowrank = kernels.load().lowrank
    calls = []
    real = lowrank.launch_lowrank_add_
    monkeypatch.setattr(lowrank, "launch_lowrank_add_", lambda *args: calls.append(args) or real(*args))
    out, a, b = _operands(24, 40, 16, torch.bfloat16)
    expected = lowrank_add_ref(out.clone(), a, b, 0.5)
    add_low_rank_(out, a, b, 0.5)
    assert len(calls) == 1
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, b_transposed", [(8192, 14336, False), (4096, 4096, True), (2048, 1024, False)])
def test_gpu_kernel_matches_twin_and_cublas_at_llama_shapes(m, n, b_transposed):
    out, a, b = _operands(m, n, 16, torch.bfloat16, device="cuda", b_transposed=b_transposed)
    expected = lowrank_add_ref(out.clone(), a, b, 2.0)
    cublas = out.clone().addmm_(a, b.t(), alpha=2.0)
    kernels.load().lowrank.lowrank_add_(out, a, b, 2.0)
    torch.testing.assert_close(out.float(), expected.float(), atol=1.6e-2, rtol=1.6e-2)
    # where the fp32 sums round differently, they differ by one ulp; nearly everywhere they agree exactly
    assert (out != expected).float().mean().item() < 1e-2
    torch.testing.assert_close(out.float(), cublas.float(), atol=1.6e-2, rtol=1.6e-2)
