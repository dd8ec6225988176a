"""``ops/kernels/swiglu.py`` against its torch twins (with and without pending low-rank terms), and
``ops/swiglu_lora.py`` (the MLP down projection fused with its SwiGLU; the whole MLP with gate/up as a projection
group, ``grouped_lora_mlp``) against fp32 autograd of the separate projections; plus what they keep for backward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peft_fastlora.ops import grouped_lora_mlp, kernels, lora_linear_group, swiglu_lora_linear
from peft_fastlora.ops.reference import (
    lora_linear_ref,
    lowrank_add_ref,
    silu_mul_backward_lora_ref,
    silu_mul_backward_ref,
    silu_mul_ref,
    silu_mul_t_matmul_ref,
)
from tests.utils import saved_bytes

from .helpers import assert_close_scaled, fp32_twin, lora_projection, make_inputs, make_weight

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


GRAD_A_CASES = [  # (dtype, atol, rtol) of t.T @ h against the twin: one fp32 sum in both, in another order; in 16-bit
    # dtypes an element of h may also round one ulp apart (the kernel's sigmoid is not torch's), which moves the sum by
    # up to |t| ulp(h): about the elementwise tolerance, far below what a wrong row or column would do
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 8e-3, 8e-3, id="bf16"),
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
    torch.testing.assert_close(dg, gate.grad, atol=1e-6, rtol=1e-5)  # the twin's math is fp32 (as the kernel's)
    torch.testing.assert_close(du, up.grad, atol=1e-6, rtol=1e-5)


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


# Pending low-rank terms: the operand the SwiGLU math sees is `operand + scaling * a @ b.T`, rounded once to its dtype.
TERM_CASES = [  # (gate, up, grad_h) terms as (rank, scaling); None: no term
    pytest.param((8, 2.0), None, None, id="gate"),
    pytest.param(None, (33, 0.5), None, id="up"),
    pytest.param(None, None, (16, 0.25), id="grad_h"),
    pytest.param((1, 0.5), (64, 0.25), (33, 2.0), id="all"),
    pytest.param((16, 1.0), (8, 2.0), (64, 0.5), id="all-other-ranks"),
]


def dyadic(*shape, dtype=torch.bfloat16):
    """Random nonzero multiples of 1/8 in [-1, 1]. Terms made of these have an ``a @ b.T`` that is exact in fp32 in any
    summation order (r <= 64), so a kernel (tl.dot) and its twin (torch) round the very same operand, and comparing
    them tests the term's rounding and the SwiGLU math: a 1-ulp flip of gate moves h by up to 2 ulps."""
    k = torch.randint(1, 9, shape) * (torch.randint(0, 2, shape) * 2 - 1)
    return (k / 8).to(dtype)


def swiglu_operands(rows, cols, r, dtype):
    """``(gate, up, grad_h, t)`` as in the tests above."""
    gate, up = (torch.randn(rows, cols) * 3).to(dtype), torch.randn(rows, cols).to(dtype)
    return gate, up, torch.randn(rows, cols).to(dtype), torch.randn(rows, r).to(dtype)


def make_terms(rows, cols, dtype, gate=None, up=None, grad_h=None):
    """Keyword arguments ``gate_term`` / ``up_term`` / ``grad_h_term`` from ``(rank, scaling)`` (or None)."""
    specs = {"gate_term": gate, "up_term": up, "grad_h_term": grad_h}
    return {name: None if s is None else (dyadic(rows, s[0], dtype=dtype), dyadic(cols, s[0], dtype=dtype), s[1])
            for name, s in specs.items()}  # fmt: skip


def forward_terms(terms):
    return {name: terms[name] for name in ("gate_term", "up_term")}


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 50), (70, 257), (0, 130), (600, 130)], ids=str)
@pytest.mark.parametrize("gate_rs, up_rs, grad_h_rs", TERM_CASES)
@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_terms_kernels_match_their_twins(force_triton, rows, cols, gate_rs, up_rs, grad_h_rs, dtype, atol, rtol):
    """The three kernels with pending terms against their twins with the same terms (600 rows: two row splits)."""
    swiglu = kernels.load().swiglu
    gate, up, grad, t = swiglu_operands(rows, cols, 16, dtype)
    terms = make_terms(rows, cols, dtype, gate_rs, up_rs, grad_h_rs)
    fwd = forward_terms(terms)
    h = swiglu.silu_mul(gate, up, **fwd)
    assert h.dtype == dtype and h.shape == gate.shape
    torch.testing.assert_close(h, silu_mul_ref(gate, up, **fwd), atol=atol, rtol=rtol)
    # the product of the h that silu_mul wrote (the twin's is of the twin's h, which may differ by an ulp here and
    # there: times t, far past the product's tolerance)
    expected = t.float().t() @ h.float()
    assert_close_scaled(swiglu.silu_mul_t_matmul(t, gate, up, **fwd), expected, 1e-5, 1e-5, "t.T @ h")
    dg, du, product = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms)
    dg_ref, du_ref, _ = silu_mul_backward_lora_ref(grad, gate, up, t, **terms)
    torch.testing.assert_close(dg, dg_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(du, du_ref, atol=atol, rtol=rtol)
    assert_close_scaled(product, expected, 1e-5, 1e-5, "t.T @ h in the backward")


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 50), (70, 257), (0, 130), (600, 130)], ids=str)
@pytest.mark.parametrize("ranks", [(8, 33), (1, 64), (16, 16)], ids=str)
@pytest.mark.parametrize("grad_h_term", [False, True], ids=["no-dh-term", "dh-term"])
@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_term_b_grads_are_summed_in_the_backward_pass(force_triton, rows, cols, ranks, grad_h_term, dtype, atol,
                                                      rtol):  # fmt: skip
    """``term_b_grads``: the backward pass also sums ``a.T @ d gate`` and ``a.T @ d up`` (the terms' B grads): against
    the fp32 product of the d gate / d up it returned, and against the twin; the other outputs unchanged by the
    flag, bit for bit (600 rows: two row splits)."""
    swiglu = kernels.load().swiglu
    gate, up, grad, t = swiglu_operands(rows, cols, 16, dtype)
    terms = make_terms(rows, cols, dtype, (ranks[0], 2.0), (ranks[1], 0.5), (64, 0.25) if grad_h_term else None)
    dg, du, product, gate_b, up_b = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms, term_b_grads=True)
    for out, term, d, name in ((gate_b, terms["gate_term"], dg, "gate"), (up_b, terms["up_term"], du, "up")):
        assert out.dtype == torch.float32 and out.shape == (term[0].shape[1], cols), name
        assert_close_scaled(out, term[0].float().t() @ d.float(), 1e-5, 1e-5, f"a_{name}.T @ d {name}")
    plain = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms)
    assert len(plain) == 3
    for x, y in zip(plain, (dg, du, product)):
        assert torch.equal(x, y)
    twin = silu_mul_backward_lora_ref(grad, gate, up, t, **terms, term_b_grads=True)
    torch.testing.assert_close(twin[0], dg, atol=atol, rtol=rtol)
    torch.testing.assert_close(twin[1], du, atol=atol, rtol=rtol)
    assert_close_scaled(twin[3], terms["gate_term"][0].float().t() @ twin[0].float(), 1e-6, 1e-6, "twin's gate")
    if rows:  # the twin's own d gate / d up may differ by an ulp here and there: close at the grads' tolerance
        assert_close_scaled(twin[3], gate_b, atol * rows**0.5, rtol, "twin against kernel, gate")
        assert_close_scaled(twin[4], up_b, atol * rows**0.5, rtol, "twin against kernel, up")


SM90_TERM_B_GRADS = """
import json
from tests.ops._sm90_ptx import sm90_ptx
from peft_fastlora.ops.kernels.swiglu import _silu_mul_lora_kernel as kernel

constexprs = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_R=16, GRAD_H=True, GATE_TERM=True, BLOCK_RG=16, G_ALIGN=8,
                  UP_TERM=True, BLOCK_RU=16, U_ALIGN=8, GRAD_H_TERM=True, BLOCK_RD=16, D_ALIGN=8, INTERPRET=False)
fp32 = ("ws_ptr", "gws_ptr", "uws_ptr")
counts = {}
for flag in (False, True):
    c = dict(constexprs, TERM_B_GRADS=flag)
    signature = {n: "constexpr" if n in c else ("*fp32" if n in fp32 else "*bf16") if n.endswith("_ptr")
                 else "fp32" if "scaling" in n else "i32" for n in kernel.arg_names}
    counts[str(flag)] = sm90_ptx(kernel, signature, c, num_warps=4).count("mma.sync")
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_term_b_grads_compile_for_sm90_as_two_more_tensor_core_dots():
    """The backward kernel with every term, compiled for sm_90 ahead of time (no GPU; a subprocess, since the
    interpreter's kernels cannot be compiled), 32 x 64 tiles on 4 warps: ``TERM_B_GRADS`` adds the two rank-16
    products ``a.T @ d gate`` and ``a.T @ d up`` as tensor-core dots (4 mma each per warp), nothing else."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SM90_TERM_B_GRADS], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"False": 16, "True": 24}, counts


def test_term_b_grads_need_both_terms(force_triton):
    swiglu = kernels.load().swiglu
    gate, up, grad, t = swiglu_operands(8, 16, 16, torch.float32)
    terms = make_terms(8, 16, torch.float32, (8, 2.0), None, None)
    for fn in (swiglu.silu_mul_backward_lora, silu_mul_backward_lora_ref):
        with pytest.raises(ValueError, match="term_b_grads"):
            fn(grad, gate, up, t, **terms, term_b_grads=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_terms_twin_is_the_twin_on_preadded_operands(dtype):
    """What a term means, bit for bit: the operand after ``lowrank_add_ref``, then the math without terms (N-D gate
    and up: the term's ``a`` has their rows)."""
    gate, up, grad = (torch.randn(2, 5, 77) * 3).to(dtype), torch.randn(2, 5, 77).to(dtype), torch.randn(2, 5, 77)
    grad, t = grad.to(dtype), torch.randn(2, 5, 8).to(dtype)
    terms = {name: (torch.randn(10, r).to(dtype), (torch.randn(77, r) / r**0.5).to(dtype), s)
             for name, r, s in (("gate_term", 16, 2.0), ("up_term", 5, 0.5), ("grad_h_term", 64, 0.25))}  # fmt: skip
    g, u, dh = (lowrank_add_ref(x.reshape(10, 77).clone(), *terms[name]).view(2, 5, 77)
                for x, name in ((gate, "gate_term"), (up, "up_term"), (grad, "grad_h_term")))  # fmt: skip
    fwd = forward_terms(terms)
    assert not torch.equal(g, gate) and not torch.equal(u, up) and not torch.equal(dh, grad)
    assert torch.equal(silu_mul_ref(gate, up, **fwd), silu_mul_ref(g, u))
    assert torch.equal(silu_mul_t_matmul_ref(t, gate, up, **fwd), silu_mul_t_matmul_ref(t, g, u))
    for x, y in zip(silu_mul_backward_lora_ref(grad, gate, up, t, **terms), silu_mul_backward_lora_ref(dh, g, u, t)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("rows, cols", [(7, 50), (600, 130)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)  # lowrank_add_: 16-bit outputs only
def test_terms_kernels_match_the_kernels_on_preadded_operands(force_triton, rows, cols, dtype):
    """The pass the terms replace: ``lowrank_add_`` into gate, up and grad_h, then the kernels without terms. h, d gate
    and d up equal, not just close: the terms' products are exact (``dyadic``), so both round ``operand + scaling *
    a @ b.T`` once from the same fp32 value (a second rounding, or none, would show); ``t.T @ h`` is summed in
    other tiles with terms (a tuning of their own), so within the product's tolerance."""
    swiglu, lowrank = kernels.load().swiglu, kernels.load().lowrank
    gate, up, grad, t = swiglu_operands(rows, cols, 16, dtype)
    terms = make_terms(rows, cols, dtype, (16, 2.0), (33, 0.5), (64, 0.25))
    g, u, dh = (lowrank.lowrank_add_(x.clone(), *terms[name])
                for x, name in ((gate, "gate_term"), (up, "up_term"), (grad, "grad_h_term")))  # fmt: skip
    fwd = forward_terms(terms)
    assert torch.equal(swiglu.silu_mul(gate, up, **fwd), swiglu.silu_mul(g, u))
    expected = swiglu.silu_mul_t_matmul(t, g, u)
    assert_close_scaled(swiglu.silu_mul_t_matmul(t, gate, up, **fwd), expected, 1e-5, 1e-5, "t.T @ h")
    dg, du, product = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms)
    dg_ref, du_ref, _ = swiglu.silu_mul_backward_lora(dh, g, u, t)
    assert torch.equal(dg, dg_ref) and torch.equal(du, du_ref)
    assert_close_scaled(product, expected, 1e-5, 1e-5, "t.T @ h in the backward")


@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_terms_read_columns_of_wider_matrices(force_triton, dtype, atol, rtol):
    """The fused LoRA MLP's layout with terms: ``a`` columns of a wider ``xa``, ``b`` an (N, r) B or the transpose of
    an (r, N) A, gate and up side by side, h into the first columns of a wider matrix, d gate over d h and d up
    beside it; ``t`` (columns of a wider matrix) both the product's and d h's term's. Kernel and twin alike."""
    swiglu = kernels.load().swiglu
    rows, cols = 70, 130
    gu = (torch.randn(rows, 2 * cols + 7) * 3).to(dtype)
    gate, up = gu[:, :cols], gu[:, cols : 2 * cols]
    xa, t = dyadic(rows, 48, dtype=dtype), dyadic(rows, 40 + 16, dtype=dtype)[:, 40:]
    terms = {"gate_term": (xa[:, :16], dyadic(cols, 16, dtype=dtype), 2.0),
             "up_term": (xa[:, 16:32], dyadic(16, cols, dtype=dtype).T, 0.5),
             "grad_h_term": (t, dyadic(16, cols, dtype=dtype).T, 1.0)}  # fmt: skip
    plain = {name: (a.contiguous(), b.contiguous(), s) for name, (a, b, s) in terms.items()}
    grad = torch.randn(rows, cols).to(dtype)
    h_ref = silu_mul_ref(gate.contiguous(), up.contiguous(), **forward_terms(plain))
    dg_ref, du_ref, _ = silu_mul_backward_lora_ref(grad, gate.contiguous(), up.contiguous(), t.contiguous(), **plain)
    for silu_mul, backward in ((swiglu.silu_mul, swiglu.silu_mul_backward_lora),
                               (silu_mul_ref, silu_mul_backward_lora_ref)):  # fmt: skip
        wide = torch.full((rows, cols + 16), float("nan"), dtype=dtype)
        h = silu_mul(gate, up, out=wide[:, :cols], **forward_terms(terms))
        assert h.data_ptr() == wide.data_ptr() and wide[:, cols:].isnan().all()
        torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
        d = torch.full((rows, 2 * cols + 16), float("nan"), dtype=dtype)
        d[:, :cols] = grad
        dg, du, product = backward(d[:, :cols], gate, up, t, grad_h_is_scratch=True, out_up=d[:, cols : 2 * cols],
                                   **terms)  # fmt: skip
        assert dg.data_ptr() == d.data_ptr() and du.data_ptr() == d[:, cols:].data_ptr()
        torch.testing.assert_close(d[:, :cols], dg_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(d[:, cols : 2 * cols], du_ref, atol=atol, rtol=rtol)
        assert d[:, 2 * cols :].isnan().all()
        assert_close_scaled(product, t.float().t() @ h.float(), 1e-5, 1e-5, "t.T @ h")  # of this h (see above)


@pytest.mark.parametrize("scratch", [False, True], ids=["grad_h-kept", "grad_h-scratch"])
def test_terms_leave_their_operands_untouched(force_triton, scratch):
    """Terms are added in registers: gate, up, grad_h and the factors are byte for byte what they were (grad_h
    holds d gate with ``grad_h_is_scratch``), kernel and twin alike."""
    swiglu = kernels.load().swiglu
    rows, cols = 70, 130
    gate, up, grad, t = swiglu_operands(rows, cols, 16, torch.bfloat16)
    terms = make_terms(rows, cols, torch.bfloat16, (16, 2.0), (8, 0.5), (33, 0.25))
    terms["up_term"] = (terms["up_term"][0], dyadic(8, cols).T, 0.5)  # b a view
    inputs = [gate, up, t] + [x for a, b, _ in terms.values() for x in (a, b)]
    before = [x.view(torch.int16).clone() for x in inputs]
    ops = ((swiglu.silu_mul, swiglu.silu_mul_t_matmul, swiglu.silu_mul_backward_lora),
           (silu_mul_ref, silu_mul_t_matmul_ref, silu_mul_backward_lora_ref))  # fmt: skip
    for silu_mul, t_matmul, backward in ops:
        grad_h = grad.clone()
        silu_mul(gate, up, **forward_terms(terms))
        t_matmul(t, gate, up, **forward_terms(terms))
        dg, _, _ = backward(grad_h, gate, up, t, grad_h_is_scratch=scratch, **terms)
        assert all(torch.equal(x.view(torch.int16), y) for x, y in zip(inputs, before))
        if scratch:
            assert dg.data_ptr() == grad_h.data_ptr()
        else:
            assert dg.data_ptr() != grad_h.data_ptr() and torch.equal(grad_h.view(torch.int16), grad.view(torch.int16))


@pytest.mark.parametrize("name", ["gate_term", "up_term", "grad_h_term"])
def test_bad_terms_are_named(force_triton, name):
    """Rank past lowrank.MAX_RANK (kernels only), ``a`` of other rows, ``b`` not (cols, r), another dtype."""
    swiglu = kernels.load().swiglu
    rows, cols = 7, 50
    gate, up, grad, t = swiglu_operands(rows, cols, 4, torch.bfloat16)
    bad = {
        "rank": (dyadic(rows, 65), dyadic(cols, 65), 1.0),
        "a rows": (dyadic(rows + 1, 8), dyadic(cols, 8), 1.0),
        "b shape": (dyadic(rows, 8), dyadic(8, cols), 1.0),
        "dtype": (dyadic(rows, 8, dtype=torch.float16), dyadic(cols, 8, dtype=torch.float16), 1.0),
    }
    for why, term in bad.items():
        calls = [(swiglu.silu_mul_backward_lora, (grad, gate, up, t))]
        if why != "rank":
            calls.append((silu_mul_backward_lora_ref, (grad, gate, up, t)))
        if name != "grad_h_term":
            calls += [(swiglu.silu_mul, (gate, up)), (swiglu.silu_mul_t_matmul, (t, gate, up))]
        for call, args in calls:
            with pytest.raises(ValueError, match=f"`{name}`"):
                call(*args, **{name: term})


@pytest.mark.gpu
def test_gpu_terms_match_preadded_operands_at_llama_shape():
    """Llama-3-8B's MLP width at 2,048 tokens, bf16, r = 16, Gaussian factors: the kernels with terms against the
    kernels without, on gate / up / grad_h that ``lowrank_add_`` pre-added (the separate passes the terms replace)."""
    swiglu, lowrank = kernels.load().swiglu, kernels.load().lowrank
    rows, cols, r = 2048, 14336, 16
    gate = (torch.randn(rows, cols, device="cuda") * 2).bfloat16()
    up, grad = torch.randn(rows, cols, device="cuda").bfloat16(), torch.randn(rows, cols, device="cuda").bfloat16()
    xa, t = torch.randn(rows, 2 * r, device="cuda").bfloat16(), torch.randn(rows, r, device="cuda").bfloat16()
    terms = {"gate_term": (xa[:, :r], (torch.randn(cols, r, device="cuda") / r**0.5).bfloat16(), 2.0),
             "up_term": (xa[:, r:], (torch.randn(r, cols, device="cuda") / r**0.5).bfloat16().T, 2.0),
             "grad_h_term": (t, (torch.randn(r, cols, device="cuda") / r**0.5).bfloat16().T, 1.0)}  # fmt: skip
    g, u, dh = (lowrank.lowrank_add_(x.clone(), *terms[name])
                for x, name in ((gate, "gate_term"), (up, "up_term"), (grad, "grad_h_term")))  # fmt: skip
    h = swiglu.silu_mul(gate, up, **forward_terms(terms))
    torch.testing.assert_close(h, swiglu.silu_mul(g, u), atol=1e-2, rtol=8e-3)
    dg, du, product = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms)
    dg_ref, du_ref, expected = swiglu.silu_mul_backward_lora(dh, g, u, t)
    torch.testing.assert_close(dg, dg_ref, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(du, du_ref, atol=1e-2, rtol=8e-3)
    assert_close_scaled(product, expected, 1e-5, 1e-5, "t.T @ h")
    *same, gate_b, up_b = swiglu.silu_mul_backward_lora(grad, gate, up, t, **terms, term_b_grads=True)
    assert all(torch.equal(x, y) for x, y in zip(same, (dg, du, product)))
    assert_close_scaled(gate_b, xa[:, :r].float().t() @ dg.float(), 1e-5, 1e-5, "a_gate.T @ d gate")
    assert_close_scaled(up_b, xa[:, r:].float().t() @ du.float(), 1e-5, 1e-5, "a_up.T @ d up")


# ---- grouped_lora_mlp: gate/up as a projection group whose LoRA terms the SwiGLU kernels add -----------------------

GROUPED_CASES = [  # (lead, hidden, intermediate, kind, (r_gate, r_up, r_down), (s_gate, s_up, s_down), biases)
    ((5,), 64, 96, "nf4-nested", (8, 8, 8), (2.0, 2.0, 2.0), False),
    ((2, 7), 128, 80, "int8", (4, 12, 16), (0.5, 2.0, 1.0), True),  # own ranks and scalings; biases on all three
    ((3,), 64, 130, "nf4", (1, 33, 2), (1.0, 0.25, 3.0), False),  # rank 1 and 33, intermediate off the column block
    ((4,), 64, 64, "nf4-nested", (72, 8, 8), (1.0, 1.0, 1.0), False),  # a rank over 64: the group adds the terms
]


def _grouped_projections(hidden, inter, kind, ranks, scalings, adapter_dtype, bias):
    """gate, up, down with fresh random weights, adapters (B never zero) and, when asked, biases."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    return [lora_projection(kind, n, k, r, s, adapter_dtype, bias) for (n, k), r, s in zip(shapes, ranks, scalings)]


def _op_of(y) -> str:
    """The autograd node that made ``y``, past the reshape of its rows."""
    fn = y.grad_fn
    while type(fn).__name__ == "ViewBackward0":
        fn = fn.next_functions[0][0]
    return type(fn).__name__


def _grouped_leaves(x, projections):
    leaves = {"x": x}
    for name, p in zip(("gate", "up", "down"), projections):
        leaves.update({f"{name}.{f}": getattr(p, f) for f in ("bias", "lora_a", "lora_b") if getattr(p, f) is not None})
    return leaves


def _fp32_mlp(x, projections):
    """fp32 autograd of the separate projections through the pure-torch reference linear."""
    x_ref, (gate, up, down) = fp32_twin(x, projections)
    g = lora_linear_ref(x_ref, gate.weight, gate.bias, gate.lora_a, gate.lora_b, gate.scaling)
    u = lora_linear_ref(x_ref, up.weight, up.bias, up.lora_a, up.lora_b, up.scaling)
    y = lora_linear_ref(F.silu(g) * u, down.weight, down.bias, down.lora_a, down.lora_b, down.scaling)
    return y, _grouped_leaves(x_ref, [gate, up, down])


@pytest.mark.parametrize("lead, hidden, inter, kind, ranks, scalings, bias", GROUPED_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_grouped_mlp_matches_fp32_autograd(force_triton, lead, hidden, inter, kind, ranks, scalings, bias, x_dtype,
                                           adapter_dtype, atol, rtol):  # fmt: skip
    projections = _grouped_projections(hidden, inter, kind, ranks, scalings, adapter_dtype, bias)
    x = torch.randn(*lead, hidden).to(x_dtype).requires_grad_()
    y = grouped_lora_mlp(x, *projections)
    y_ref, ref = _fp32_mlp(x, projections)
    assert _op_of(y) == "SwiGLULoraFunctionBackward" and y.dtype == x_dtype
    assert_close_scaled(y, y_ref, atol, rtol, "y")
    grad = torch.randn_like(y_ref)
    y.backward(grad.to(y.dtype))
    y_ref.backward(grad)
    for name, leaf in _grouped_leaves(x, projections).items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        assert_close_scaled(leaf.grad, ref[name].grad, atol, rtol, f"d {name}")


def _old_composition(x, gate, up, down):
    """The fused path before the pending terms: the group adds gate's and up's terms itself."""
    g, u = lora_linear_group(x, [gate, up])
    return swiglu_lora_linear(g, u, down.weight, down.bias, down.lora_a, down.lora_b, down.scaling)


def test_grouped_mlp_never_passes_over_gate_up_or_dh_for_lora(force_triton, monkeypatch):
    """The point: no low-rank term is added to an (M, intermediate) tensor in a pass of its own: the SwiGLU kernel adds
    gate's and up's, the SwiGLU backward the down projection's ``t @ A`` into ``dh`` (the hidden-wide passes remain:
    the down projection's output and the group's ``dx``);
    autograd keeps the same bytes as the composition it replaces, and gets the same results within rounding."""
    from peft_fastlora.ops import lora_group
    from peft_fastlora.ops import lora_linear as lora_linear_module

    passes = []
    for mod in (lora_group, lora_linear_module):
        real = mod.add_low_rank_
        monkeypatch.setattr(mod, "add_low_rank_", lambda out, *a, real=real, **k: passes.append(out.shape) or
                            real(out, *a, **k))  # fmt: skip
    projections = _grouped_projections(64, 96, "nf4-nested", (8, 8, 8), (2.0, 2.0, 2.0), torch.bfloat16, False)
    x = torch.randn(12, 64).bfloat16().requires_grad_()
    y = grouped_lora_mlp(x, *projections)
    assert passes == [(12, 64)]  # the down projection's own output (hidden-wide); none over gate or up
    y.backward(torch.randn_like(y))
    assert passes == [(12, 64), (12, 64)]  # and the group's dx; none over dh
    grads = {name: leaf.grad for name, leaf in _grouped_leaves(x, projections).items()}
    for leaf in _grouped_leaves(x, projections).values():
        leaf.grad = None
    passes.clear()
    y_old = _old_composition(x, *projections)
    assert passes == [(12, 96), (12, 96), (12, 64)]  # gate's and up's terms, each a pass of its own
    assert_close_scaled(y, y_old, 3e-2, 3e-2, "y")
    y_old.backward(torch.ones_like(y_old))  # (grads not compared: different incoming grad; the fp32 test does)
    assert saved_bytes(lambda: grouped_lora_mlp(x, *projections)) == saved_bytes(
        lambda: _old_composition(x, *projections))
    assert all(g is not None for g in grads.values())


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=["bf16-adapters", "fp32-adapters"])
def test_grouped_mlp_sums_gate_up_b_grads_in_the_swiglu_pass(force_triton, monkeypatch, adapter_dtype):
    """The gate and up B grads come from the SwiGLU backward's pass (no ``lora_b_grad`` reading d gate / d up back),
    and equal the two-matmul path's within the sums' order; the other grads are the same tensors' values, bit for
    bit."""
    from peft_fastlora.ops import swiglu_lora

    calls = []
    real = swiglu_lora.lora_b_grad
    monkeypatch.setattr(swiglu_lora, "lora_b_grad", lambda g, *a, **k: calls.append(tuple(g.shape)) or real(g, *a, **k))
    projections = _grouped_projections(64, 96, "nf4-nested", (8, 16, 8), (2.0, 0.5, 1.0), adapter_dtype, False)
    x = torch.randn(300, 64).bfloat16().requires_grad_()
    grad = torch.randn(300, 64).bfloat16()

    def grads(in_pass):
        monkeypatch.setattr(swiglu_lora, "B_GRADS_IN_SWIGLU_PASS", in_pass)
        calls.clear()
        for leaf in _grouped_leaves(x, projections).values():
            leaf.grad = None
        grouped_lora_mlp(x, *projections).backward(grad)
        return {name: leaf.grad.clone() for name, leaf in _grouped_leaves(x, projections).items()}, list(calls)

    fused, fused_calls = grads(True)
    separate, separate_calls = grads(False)
    assert fused_calls == [] and separate_calls == [(300, 96), (300, 96)]
    for name in fused:
        if name in ("gate.lora_b", "up.lora_b"):
            assert fused[name].dtype == adapter_dtype and fused[name].is_contiguous()
            assert_close_scaled(fused[name], separate[name], 1e-2, 1e-2, f"d {name}")
        else:
            assert torch.equal(fused[name], separate[name]), name


def test_grouped_mlp_on_zero_rows(force_triton):
    projections = _grouped_projections(64, 96, "nf4", (8, 4, 8), (2.0, 1.0, 0.5), torch.bfloat16, True)
    x = torch.randn(0, 64).bfloat16().requires_grad_()
    y = grouped_lora_mlp(x, *projections)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and projections[0].lora_b.grad.abs().sum() == 0


def test_grouped_mlp_reference_path_is_the_plain_composition(reference_path):
    projections = _grouped_projections(64, 96, "nf4-nested", (8, 8, 8), (2.0, 2.0, 2.0), torch.float32, True)
    x = torch.randn(6, 64, requires_grad=True)
    y = grouped_lora_mlp(x, *projections)
    assert _op_of(y) != "SwiGLULoraFunctionBackward"
    y_ref, _ = _fp32_mlp(x, projections)
    assert_close_scaled(y, y_ref, 1e-4, 1e-4, "y")


def test_grouped_mlp_refuses_mismatched_projections():
    gate, up, down = _grouped_projections(64, 96, "nf4", (8, 8, 8), (1.0, 1.0, 1.0), torch.float32, False)
    with pytest.raises(ValueError, match="`gate`, `up`, `down` weights"):
        grouped_lora_mlp(torch.randn(3, 64), gate, up, gate)
    with pytest.raises(TypeError, match="LoraProjection"):
        grouped_lora_mlp(torch.randn(3, 64), gate, (up.weight, up.lora_a), down)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
def test_gpu_grouped_mlp_matches_the_composition_it_replaces(kind):
    """Llama-3-8B's MLP width at 1,024 tokens, bf16: output and every grad agree with the group + fused down
    projection composition within bf16 rounding."""
    torch.manual_seed(0)
    hidden, inter = 4096, 14336
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    projections = [lora_projection(kind, n, k, 16, 2.0, torch.bfloat16, device="cuda") for n, k in shapes]
    x = torch.randn(1024, hidden, device="cuda").bfloat16().requires_grad_()
    grad = torch.randn(1024, hidden, device="cuda").bfloat16()
    results = []
    for fn in (grouped_lora_mlp, _old_composition):
        y = fn(x, *projections)
        y.backward(grad)
        leaves = _grouped_leaves(x, projections)
        results.append((y.detach(), {n: t.grad.clone() for n, t in leaves.items()}))
        for t in leaves.values():
            t.grad = None
    (y_new, g_new), (y_old, g_old) = results
    assert_close_scaled(y_new, y_old, 2e-2, 2e-2, "y")
    for name in g_old:
        assert_close_scaled(g_new[name], g_old[name], 3e-2, 3e-2, f"d {name}")
