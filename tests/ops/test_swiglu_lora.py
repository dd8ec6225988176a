"""``ops/kernels/swiglu.py`` against its torch twins, and ``ops/swiglu_lora.py`` (the MLP down projection fused with
its SwiGLU) against fp32 autograd of ``lora_linear_ref(silu(gate) * up, ...)``; plus what it keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peft_fastlora.ops import kernels, swiglu_lora_linear
from peft_fastlora.ops.reference import (
    lora_linear_ref,
    silu_mul_backward_lora_ref,
    silu_mul_backward_ref,
    silu_mul_ref,
    silu_mul_t_matmul_ref,
)
from tests.utils import saved_bytes

from .helpers import assert_close_scaled, make_inputs, make_weight

ELEMENTWISE_CASES = [  # (dtype, atol, rtol): fp32 math in both, one rounding; sigmoid differs by ulps
    pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 8e-3, 8e-3, id="bf16"),
]
DTYPE_CASES = [  # (x dtype, adapter dtype, atol, rtol) against fp32 autograd, as in test_lora_linear.py
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.float16, torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 3e-2, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 3e-2, id="bf16-fp32adapters"),
]


@pytest.mark.parametrize("shape", [(7,), (3, 1000), (2, 5, 77)], ids=str)  # numel below, at and off the block
@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_kernels_match_their_twins(force_triton, shape, dtype, atol, rtol):
    swiglu = kernels.load().swiglu
    gate, up, grad = (torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    h = swiglu.silu_mul(gate, up)
    assert h.dtype == dtype and h.shape == gate.shape
    torch.testing.assert_close(h, silu_mul_ref(gate, up), atol=atol, rtol=rtol)
    dg, du = swiglu.silu_mul_backward(grad, gate, up)
    dg_ref, du_ref = silu_mul_backward_ref(grad, gate, up)
    torch.testing.assert_close(dg, dg_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(du, du_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_backward_into_its_gradient_matches_the_twin(force_triton, dtype, atol, rtol):
    """``grad_h_is_scratch``: d gate is written over grad_h (kernel and twin alike); d up is its own tensor. A grad
    of another dtype than gate is not reused."""
    swiglu = kernels.load().swiglu
    gate, up = (torch.randn(3, 1000) * 3).to(dtype), torch.randn(3, 1000).to(dtype)
    grad = torch.randn(3, 1000).to(dtype)
    dg_ref, du_ref = silu_mul_backward_ref(grad, gate, up)
    for backward in (swiglu.silu_mul_backward, silu_mul_backward_ref):
        scratch = grad.clone()
        dg, du = backward(scratch, gate, up, grad_h_is_scratch=True)
        assert dg.data_ptr() == scratch.data_ptr() and du.data_ptr() != scratch.data_ptr()
        torch.testing.assert_close(dg, dg_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(du, du_ref, atol=atol, rtol=rtol)
    other = grad.double() if dtype != torch.float32 else grad.half()
    dg, _ = swiglu.silu_mul_backward(other, gate, up, grad_h_is_scratch=True)
    assert dg.dtype == dtype and dg.data_ptr() != other.data_ptr()


@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_kernels_read_and_write_columns_of_wider_matrices(force_triton, dtype, atol, rtol):
    """The fused LoRA MLP's layout: gate and up side by side in one matrix, h written into the first columns of
    another, d gate over d h and d up beside it; kernel and twin alike, the other columns untouched."""
    swiglu = kernels.load().swiglu
    rows, cols = 5, 300
    gu = (torch.randn(rows, 2 * cols + 7) * 3).to(dtype)
    gate, up = gu[:, :cols], gu[:, cols : 2 * cols]
    for silu_mul, backward in ((swiglu.silu_mul, swiglu.silu_mul_backward),
                               (silu_mul_ref, silu_mul_backward_ref)):  # fmt: skip
        wide = torch.full((rows, cols + 16), float("nan"), dtype=dtype)
        h = silu_mul(gate, up, out=wide[:, :cols])
        assert h.data_ptr() == wide.data_ptr() and wide[:, cols:].isnan().all()
        torch.testing.assert_close(h, silu_mul_ref(gate.contiguous(), up.contiguous()), atol=atol, rtol=rtol)
        grad = torch.randn(rows, cols).to(dtype)
        d = torch.full((rows, 2 * cols + 16), float("nan"), dtype=dtype)
        d[:, :cols] = grad
        dg, du = backward(d[:, :cols], gate, up, grad_h_is_scratch=True, out_up=d[:, cols : 2 * cols])
        assert dg.data_ptr() == d.data_ptr() and du.data_ptr() == d[:, cols:].data_ptr()
        dg_ref, du_ref = silu_mul_backward_ref(grad, gate.contiguous(), up.contiguous())
        torch.testing.assert_close(d[:, :cols], dg_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(d[:, cols : 2 * cols], du_ref, atol=atol, rtol=rtol)
        assert d[:, 2 * cols :].isnan().all()


GRAD_A_CASES = [  # (dtype, atol, rtol) of t.T @ h against the twin: one fp32 sum in both, in another order
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-5, 1e-5, id="fp16"),
    pytest.param(torch.bfloat16, 1e-5, 1e-5, id="bf16"),
]


@pytest.mark.parametrize("rows, cols, r", [(7, 50, 16), (600, 130, 8), (70, 257, 33), (1, 1, 1), (40, 64, 128),
                                           (0, 5, 4)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype, atol, rtol", GRAD_A_CASES)
def test_lora_grad_kernels_match_their_twins(force_triton, rows, cols, r, dtype, atol, rtol):
    """``t.T @ silu(gate) * up`` alone and inside the SwiGLU backward; 600 rows run in two row splits."""
    swiglu = kernels.load().swiglu
    gate, up = (torch.randn(rows, cols) * 3).to(dtype), torch.randn(rows, cols).to(dtype)
    t, grad = torch.randn(rows, r).to(dtype), torch.randn(rows, cols).to(dtype)
    expected = silu_mul_t_matmul_ref(t, gate, up)
    product = swiglu.silu_mul_t_matmul(t, gate, up)
    assert product.dtype == torch.float32 and product.shape == (r, cols)
    assert_close_scaled(product, expected, atol, rtol, "t.T @ h")
    dg, du, product = swiglu.silu_mul_backward_lora(grad.clone(), gate, up, t)
    dg_ref, du_ref, _ = silu_mul_backward_lora_ref(grad, gate, up, t)
    assert_close_scaled(product, expected, atol, rtol, "t.T @ h in the backward")
    ew_atol, ew_rtol = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[dtype]
    torch.testing.assert_close(dg, dg_ref, atol=ew_atol, rtol=ew_rtol)
    torch.testing.assert_close(du, du_ref, atol=ew_atol, rtol=ew_rtol)


@pytest.mark.parametrize("dtype, atol, rtol", GRAD_A_CASES[1:])
def test_lora_grad_backward_reads_and_writes_columns_of_wider_matrices(force_triton, dtype, atol, rtol):
    """The fused LoRA MLP's layout (as for the plain backward), with t the last columns of a wider matrix too."""
    swiglu = kernels.load().swiglu
    rows, cols, r = 300, 150, 16
    gu = (torch.randn(rows, 2 * cols + 7) * 3).to(dtype)
    gate, up = gu[:, :cols], gu[:, cols : 2 * cols]
    tc = torch.randn(rows, 40 + r).to(dtype)
    t = tc[:, 40:]
    grad = torch.randn(rows, cols).to(dtype)
    d = torch.full((rows, 2 * cols + 16), float("nan"), dtype=dtype)
    d[:, :cols] = grad
    dg, du, product = swiglu.silu_mul_backward_lora(d[:, :cols], gate, up, t, grad_h_is_scratch=True,
                                                    out_up=d[:, cols : 2 * cols])  # fmt: skip
    assert dg.data_ptr() == d.data_ptr() and du.data_ptr() == d[:, cols:].data_ptr()
    dg_ref, du_ref, expected = silu_mul_backward_lora_ref(grad, gate.contiguous(), up.contiguous(), t.contiguous())
    torch.testing.assert_close(d[:, :cols], dg_ref, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(d[:, cols : 2 * cols], du_ref, atol=8e-3, rtol=8e-3)
    assert d[:, 2 * cols :].isnan().all()
    assert_close_scaled(product, expected, atol, rtol, "t.T @ h")


def test_lora_grad_twin_is_the_product_with_h_as_written():
    """The twin multiplies by h rounded to the activation dtype, the h the forward's down projection read."""
    gate, up, t = torch.randn(33, 20).bfloat16(), torch.randn(33, 20).bfloat16(), torch.randn(33, 4).bfloat16()
    h = silu_mul_ref(gate, up)
    torch.testing.assert_close(silu_mul_t_matmul_ref(t, gate, up), t.double().t().matmul(h.double()).float())


def test_backward_twin_is_autograd_of_the_forward_twin():
    gate, up = torch.randn(64, dtype=torch.float64, requires_grad=True), torch.randn(64, dtype=torch.float64)
    up.requires_grad_()
    grad = torch.randn(64, dtype=torch.float64)
    (F.silu(gate) * up).backward(grad)
    dg, du = silu_mul_backward_ref(grad, gate.detach(), up.detach())
    torch.testing.assert_close(dg, gate.grad)
    torch.testing.assert_close(du, up.grad)


def fused_and_reference(lead, n, k, kind, x_dtype, adapter_dtype, bias=True):
    """CPU tensors: the callers test the interpreted Triton path (``force_triton``) or the CPU reference path."""
    weight = make_weight(kind, n, k, device="cpu")
    _, b, a, bb, _ = make_inputs(lead, n, k, x_dtype, adapter_dtype, requires_grad=True, bias=bias, device="cpu")
    if b is not None:
        b.requires_grad_()
    gate = (torch.randn(*lead, k) * 2).to(x_dtype).requires_grad_()
    up = torch.randn(*lead, k).to(x_dtype).requires_grad_()
    leaves = {"gate": gate, "up": up, "bias": b, "lora_a": a, "lora_b": bb}
    ref = {name: None if t is None else t.detach().float().requires_grad_() for name, t in leaves.items()}
    y = swiglu_lora_linear(gate, up, weight, b, a, bb, 2.0)
    h_ref = F.silu(ref["gate"]) * ref["up"]
    y_ref = lora_linear_ref(h_ref, weight, ref["bias"], ref["lora_a"], ref["lora_b"], 2.0)
    return y, y_ref, leaves, ref


@pytest.mark.parametrize("lead, n, k", [((1,), 40, 64), ((2, 3), 72, 128), ((17,), 48, 192)], ids=str)
@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_fused_matches_fp32_autograd(force_triton, lead, n, k, kind, x_dtype, adapter_dtype, atol, rtol):
    y, y_ref, leaves, ref = fused_and_reference(lead, n, k, kind, x_dtype, adapter_dtype)
    assert type(y.grad_fn).__name__ == "SwiGLULoraFunctionBackward"
    assert y.dtype == x_dtype and y.shape == y_ref.shape
    assert_close_scaled(y, y_ref, atol, rtol, "y")
    grad = torch.randn_like(y_ref)
    y.backward(grad.to(y.dtype))
    y_ref.backward(grad)
    for name, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert_close_scaled(t.grad, ref[name].grad, atol, rtol, f"d{name}")


def test_reference_path_is_the_plain_composition(reference_path):
    y, y_ref, leaves, ref = fused_and_reference((4,), 24, 64, "nf4-nested", torch.float32, torch.float32)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ != "SwiGLULoraFunctionBackward"
    assert_close_scaled(y, y_ref, 1e-4, 1e-4, "y")


def test_keeps_gate_and_up_but_not_h(force_triton):
    """The point of the fusion: backward gets gate, up, xa and the adapters, never h = silu(gate) * up."""
    n, k, rows = 32, 256, 64
    weight = make_weight("nf4-nested", n, k)
    _, bias, a, b, _ = make_inputs((rows,), n, k, torch.float32, requires_grad=True)
    gate, up = torch.randn(rows, k, requires_grad=True), torch.randn(rows, k, requires_grad=True)
    small = a.nbytes + b.nbytes + rows * a.shape[0] * 4  # adapters and xa
    fused = saved_bytes(lambda: swiglu_lora_linear(gate, up, weight, bias, a, b, 2.0))
    assert fused == gate.nbytes + up.nbytes + small
    unfused = saved_bytes(lambda: kernels_path_unfused(gate, up, weight, bias, a, b))
    assert unfused >= fused + gate.nbytes  # h (and silu's own saved tensors) on top


def test_backward_never_makes_h(force_triton, monkeypatch):
    """dA comes from gate and up inside the SwiGLU backward: backward makes no h at all (it made one before W was
    dequantized, and h and W set the peak together), and the grads still match fp32 autograd."""
    swiglu = kernels.load().swiglu
    made = []
    real_silu_mul = swiglu.silu_mul
    monkeypatch.setattr(swiglu, "silu_mul", lambda *args, **kw: made.append(args) or real_silu_mul(*args, **kw))
    y, y_ref, leaves, ref = fused_and_reference((6,), 24, 64, "nf4-nested", torch.float32, torch.float32)
    assert len(made) == 1  # the forward's
    grad = torch.randn_like(y_ref)
    y.backward(grad)
    y_ref.backward(grad)
    assert len(made) == 1
    for name in ("gate", "up", "lora_a", "lora_b"):
        assert_close_scaled(leaves[name].grad, ref[name].grad, 1e-4, 1e-4, name)


def test_lora_grad_without_gate_and_up_grads(force_triton):
    """Frozen gate and up (no grad wanted): dA alone, from the product kernel."""
    weight = make_weight("nf4-nested", 24, 64, device="cpu")
    _, _, a, bb, _ = make_inputs((5,), 24, 64, torch.float32, requires_grad=True, bias=False, device="cpu")
    gate, up = torch.randn(5, 64) * 2, torch.randn(5, 64)
    swiglu_lora_linear(gate, up, weight, None, a, bb, 2.0).square().sum().backward()
    ref_a, ref_b = a.detach().clone().requires_grad_(), bb.detach().clone().requires_grad_()
    lora_linear_ref(F.silu(gate) * up, weight, None, ref_a, ref_b, 2.0).square().sum().backward()
    assert_close_scaled(a.grad, ref_a.grad, 1e-4, 1e-4, "lora_a")
    assert_close_scaled(bb.grad, ref_b.grad, 1e-4, 1e-4, "lora_b")


def kernels_path_unfused(gate, up, weight, bias, a, b):
    from peft_fastlora.ops import fastlora_linear

    return fastlora_linear(F.silu(gate) * up, weight, bias, a, b, 2.0)


def test_bad_gate_and_up_are_named(force_triton):
    weight = make_weight("nf4-nested", 8, 64)
    with pytest.raises(ValueError, match="`gate` and `up` must have one shape"):
        swiglu_lora_linear(torch.randn(2, 64), torch.randn(3, 64), weight, None, None, None, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
def test_gpu_fused_matches_unfused_at_llama_shape(kind):
    """Llama-3-8B's down projection (14336 -> 4096) over 512 tokens in bf16: output and grads of the fused op against
    the unfused composition through the same door, within bf16 rounding."""
    from peft_fastlora.ops import fastlora_linear

    n, k, rows = 4096, 14336, 512
    weight = make_weight(kind, n, k, device="cuda")
    _, bias, a, b, _ = make_inputs((rows,), n, k, torch.bfloat16, device="cuda", requires_grad=True, bias=False, r=16)
    gate = (torch.randn(rows, k, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    up = torch.randn(rows, k, device="cuda").to(torch.bfloat16).requires_grad_()
    leaves = [gate, up, a, b]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    y = swiglu_lora_linear(gate, up, weight, None, a, b, 2.0)
    assert type(y.grad_fn).__name__ == "SwiGLULoraFunctionBackward"
    y_ref = fastlora_linear(F.silu(twins[0]) * twins[1], weight, None, twins[2], twins[3], 2.0)
    assert_close_scaled(y, y_ref, 2e-2, 2e-2, "y")
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    for name, t, twin in zip(("gate", "up", "lora_a", "lora_b"), leaves, twins):
        assert_close_scaled(t.grad, twin.grad, 3e-2, 3e-2, f"d{name}")


def test_autocast_casts_gate_and_up_like_the_down_projection_would(force_triton):
    """Under autocast the fused op sees gate and up in the autocast dtype (what nn.Linear would do to h), runs with
    autocast off inside, and restores it."""
    weight = make_weight("nf4-nested", 24, 64)
    _, bias, a, b, _ = make_inputs((5,), 24, 64, torch.bfloat16, adapter_dtype=torch.float32)
    gate, up = torch.randn(5, 64), torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = swiglu_lora_linear(gate, up, weight, bias, a, b, 2.0)
        assert torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.bfloat16
    expected = swiglu_lora_linear(gate.bfloat16(), up.bfloat16(), weight, bias, a, b, 2.0)
    assert torch.equal(y, expected)
