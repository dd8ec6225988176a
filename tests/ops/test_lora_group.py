"""``ops/lora_group.py`` (LoRA projections of one input, as q/k/v, as one op) against fp32 autograd of the separate
projections; unused outputs, biases, mixed ranks and scalings, the input gradient summed inside the matmuls, what it
keeps for backward, and its refusals."""

from __future__ import annotations

import importlib

import pytest
import torch

from peft_fastlora.ops import LoraProjection, lora_linear, lora_linear_group
from peft_fastlora.ops.lora_group import lora_linear_group_ref
from peft_fastlora.ops.reference import lora_linear_ref
from tests.utils import saved_bytes

from .helpers import assert_close_scaled, fp32_twin, lora_projection, record_windows

module = importlib.import_module("peft_fastlora.ops.lora_group")

DTYPE_CASES = [  # (x dtype, adapter dtype, atol, rtol) against fp32 autograd, as in test_lora_mlp.py
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.float16, torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 3e-2, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 3e-2, id="bf16-fp32adapters"),
]


def group(kind, k, outs, ranks, scalings, adapter_dtype, bias=False, device="cpu"):
    return [lora_projection(kind, n, k, r, s, adapter_dtype, bias, device) for n, r, s in zip(outs, ranks, scalings)]


def leaves_of(x, projections):
    return [x] + [t for p in projections for t in (p.bias, p.lora_a, p.lora_b) if t is not None]


def names_of(projections):
    names = ["x"]
    for i, p in enumerate(projections):
        names += [f"p{i}.{name}" for name in ("bias", "lora_a", "lora_b") if getattr(p, name) is not None]
    return names


def separate_fp32(x, projections):
    """fp32 autograd through the pure-torch reference linear, one projection at a time."""
    return [lora_linear_ref(x, p.weight, p.bias, p.lora_a, p.lora_b, p.scaling) for p in projections]


CASES = [  # (lead, in_features, out_features per projection, kind, ranks, scalings, bias)
    ((5,), 64, (64, 32, 32), "nf4-nested", (8, 8, 8), (2.0, 2.0, 2.0), False),  # q, k, v of a GQA block
    ((2, 7), 128, (96, 33, 64), "int8", (4, 12, 8), (0.5, 2.0, 1.0), True),  # own ranks, scalings; Qwen2's biases
    ((3,), 128, (128, 128), "fp4-128", (16, 4), (1.0, 0.25), False),  # two projections
    ((1,), 64, (48,), "nf4", (8,), (2.0,), True),  # one projection: the op is then one fastlora_linear
]


@pytest.mark.parametrize("lead, k, outs, kind, ranks, scalings, bias", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_group_matches_fp32_autograd(force_triton, lead, k, outs, kind, ranks, scalings, bias, x_dtype,
                                     adapter_dtype, atol, rtol):  # fmt: skip
    projections = group(kind, k, outs, ranks, scalings, adapter_dtype, bias)
    x = torch.randn(*lead, k).to(x_dtype).requires_grad_()
    ys = lora_linear_group(x, projections)
    assert {type(y.grad_fn.next_functions[0][0]).__name__ for y in ys} <= {"LoraGroupFunctionBackward"}
    x_ref, twins = fp32_twin(x, projections)
    ys_ref = separate_fp32(x_ref, twins)
    grads = [torch.randn_like(y) for y in ys_ref]
    for i, (y, y_ref) in enumerate(zip(ys, ys_ref)):
        assert y.dtype == x_dtype and y.shape == (*lead, outs[i])
        assert_close_scaled(y, y_ref, atol, rtol, f"y{i}")
    torch.autograd.backward(ys, [g.to(x_dtype) for g in grads])
    torch.autograd.backward(ys_ref, grads)
    for name, t, ref in zip(names_of(projections), leaves_of(x, projections), leaves_of(x_ref, twins)):
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert_close_scaled(t.grad, ref.grad, atol, rtol, f"d{name}")


@pytest.mark.parametrize("case", ["zero rows", "stacked rank over 64", "mixed adapter dtypes"])
def test_awkward_groups(force_triton, case):
    """No rows; ranks whose sum passes the low-rank kernel's 64 (``dx`` then takes cuBLAS' ``addmm_``); adapters of
    two dtypes in one group (each ``dA`` its own matmul, in its adapter's dtype)."""
    ranks, rows = ((8, 8, 8), 5) if case != "stacked rank over 64" else ((32, 32, 16), 5)
    rows = 0 if case == "zero rows" else rows
    projections = group("nf4-nested", 64, (64, 32, 32), ranks, (2.0, 1.0, 0.5), torch.bfloat16)
    if case == "mixed adapter dtypes":
        p = projections[1]
        projections[1] = p._replace(lora_a=p.lora_a.detach().float().requires_grad_(),
                                    lora_b=p.lora_b.detach().float().requires_grad_())  # fmt: skip
    x = torch.randn(rows, 64).bfloat16().requires_grad_()
    ys = lora_linear_group(x, projections)
    x_ref, twins = fp32_twin(x, projections)
    ys_ref = separate_fp32(x_ref, twins)
    grads = [torch.randn_like(y) for y in ys_ref]
    torch.autograd.backward(ys, [g.bfloat16() for g in grads])
    torch.autograd.backward(ys_ref, grads)
    for y, y_ref in zip(ys, ys_ref):
        assert y.shape == y_ref.shape
        assert_close_scaled(y, y_ref, 3e-2, 3e-2, "y")
    for name, t, ref in zip(names_of(projections), leaves_of(x, projections), leaves_of(x_ref, twins)):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        assert_close_scaled(t.grad, ref.grad, 3e-2, 3e-2, f"d{name}")


def test_an_unused_output_counts_as_a_zero_grad(force_triton):
    """A graph that uses some outputs only (the others' grads are None, never materialised as zeros): the grads are
    those of the used projections alone, and the unused projection's adapter gets none."""
    projections = group("nf4-nested", 64, (64, 32, 32), (8, 4, 8), (2.0, 1.0, 0.5), torch.float32, bias=True)
    x = torch.randn(6, 64, requires_grad=True)
    q, _, v = lora_linear_group(x, projections)
    (q.square().sum() + v.sum()).backward()
    x_ref, twins = fp32_twin(x, projections)
    q_ref, _, v_ref = separate_fp32(x_ref, twins)
    (q_ref.square().sum() + v_ref.sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    for used in (0, 2):
        for t, ref in zip(leaves_of(x, projections[used : used + 1])[1:], leaves_of(x_ref, twins[used : used + 1])[1:]):
            torch.testing.assert_close(t.grad, ref.grad, atol=1e-4, rtol=1e-4)
    assert all(t.grad is None for t in (projections[1].lora_a, projections[1].lora_b, projections[1].bias))


def test_input_grad_is_summed_inside_the_matmuls(force_triton, monkeypatch):
    """The second and third projections' ``g @ W`` accumulate into the first one's ``dx`` (cuBLAS' beta=1), the
    low-rank terms go in with one pass of rank r_1 + r_2 + r_3, and ``x`` is read once for all ``dA``s."""
    projections = group("nf4-nested", 64, (64, 32, 32), (8, 4, 8), (2.0, 1.0, 0.5), torch.float32)
    x = torch.randn(6, 64, requires_grad=True)
    calls, adds, a_grads = [], [], []
    real_grad, real_add, real_matmul = module._input_grad, module.add_low_rank_, module._matmul
    monkeypatch.setattr(module, "_input_grad", lambda g, w, accumulate, windows: calls.append(accumulate is not None)
                        or real_grad(g, w, accumulate, windows))  # fmt: skip
    monkeypatch.setattr(module, "add_low_rank_", lambda out, a, b, s: adds.append(a.shape[1])
                        or real_add(out, a, b, s))  # fmt: skip
    monkeypatch.setattr(module, "_matmul", lambda a, b, dtype: a_grads.append(tuple(a.shape))
                        or real_matmul(a, b, dtype))  # fmt: skip
    torch.autograd.backward(lora_linear_group(x, projections), [torch.randn(6, n) for n in (64, 32, 32)])
    assert calls == [False, True, True]
    assert adds == [8, 4, 8, 20]  # three forward adds (each output its own), one backward add
    assert a_grads == [(20, 6)]


def test_windows_give_the_same_result(force_triton, monkeypatch):
    """Under checkpointing, inside the backward pass (the forward that checkpointing recomputes, and dx) the weights
    are cut into row windows (forward) and column windows (backward, accumulating into dx); the first forward makes
    them whole, and so does every pass without checkpointing. Either way the result is what whole weights give."""
    projections = group("nf4-nested", 128, (256, 128), (4, 8), (1.0, 2.0), torch.float32, bias=True)
    x = torch.randn(6, 128, requires_grad=True)
    grads = [torch.randn(6, 256), torch.randn(6, 128)]

    def run(checkpointed: bool):
        for t in leaves_of(x, projections):
            t.grad = None
        if checkpointed:
            ys = torch.utils.checkpoint.checkpoint(lora_linear_group, x, projections, use_reentrant=False)
        else:
            ys = lora_linear_group(x, projections)
        torch.autograd.backward(ys, grads)
        return [y.detach() for y in ys] + [t.grad.clone() for t in leaves_of(x, projections)]

    outside, inside = record_windows(monkeypatch, lora_linear)
    whole = run(False)
    # without checkpointing the peak is elsewhere: W whole, forward and backward
    assert len(outside) == 2 and len(inside) == 2 and all(len(w) == 1 for w in outside + inside)
    outside.clear()
    inside.clear()
    windowed = run(True)
    assert len(outside) == 2 and all(len(w) == 1 for w in outside)  # the first forward: W whole
    assert len(inside) == 4 and all(len(w) >= 2 for w in inside)  # the recomputed forward, then dx
    for i, (got, expected) in enumerate(zip(windowed, whole)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=str(i))


def test_keeps_x_once(force_triton):
    """Backward gets x once (for every dA), the stacked xa and the adapters; never a dequantized weight."""
    rows, k = 16, 64
    projections = group("nf4-nested", k, (64, 32, 32), (8, 4, 8), (1.0, 1.0, 1.0), torch.float32)
    x = torch.randn(rows, k, requires_grad=True)
    adapters = sum(t.nbytes for p in projections for t in (p.lora_a, p.lora_b))
    assert saved_bytes(lambda: lora_linear_group(x, projections)) == rows * k * 4 + rows * 20 * 4 + adapters
    for p in projections:
        p.lora_a.requires_grad_(False)
    assert saved_bytes(lambda: lora_linear_group(x, projections)) == rows * 20 * 4 + adapters  # no dA: no x


def test_reference_path_on_cpu(reference_path):
    projections = group("nf4-nested", 64, (64, 32), (8, 8), (2.0, 2.0), torch.float32)
    x = torch.randn(4, 64, requires_grad=True)
    ys = lora_linear_group(x, projections)
    assert "LoraGroup" not in str(ys[0].grad_fn)
    for y, ref in zip(ys, lora_linear_group_ref(x, projections)):
        torch.testing.assert_close(y, ref, atol=0, rtol=0)


def test_autocast_runs_the_op_in_the_autocast_dtype(force_triton):
    projections = group("nf4-nested", 64, (64, 32), (8, 8), (2.0, 2.0), torch.float32, bias=True)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = lora_linear_group(x, projections)
        assert torch.is_autocast_enabled("cpu")
    for y, plain in zip(ys, lora_linear_group(x.bfloat16(), projections)):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, plain, atol=0, rtol=0)


def test_bad_projections_are_named(force_triton):
    q, k = group("nf4-nested", 64, (64, 32), (8, 8), (2.0, 2.0), torch.float32)
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="non-empty sequence"):
        lora_linear_group(x, [])
    with pytest.raises(TypeError, match="non-empty sequence"):
        lora_linear_group(x, q)
    with pytest.raises(TypeError, match=r"`projections\[1\]` must be a LoraProjection"):
        lora_linear_group(x, [q, (k.weight, k.lora_a, k.lora_b, 1.0)])
    with pytest.raises(ValueError, match=r"`projections\[1\]` has no adapter"):
        lora_linear_group(x, [q, LoraProjection(k.weight, None, None, 1.0)])
    with pytest.raises(ValueError, match="in_features=64"):
        lora_linear_group(torch.randn(4, 32), [q, k])
    with pytest.raises(ValueError, match="`bias` must have shape"):
        lora_linear_group(x, [q, k._replace(bias=torch.zeros(3))])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
def test_gpu_group_matches_fp32_at_llama_shape(kind):
    """Llama-3-8B's q, k, v (4096 -> 4096 / 1024 / 1024) over 2048 tokens in bf16, r=16: outputs and every grad
    within bf16 rounding of fp32 autograd, and no further from it than the separate ops in bf16."""
    torch.manual_seed(0)
    projections = group(kind, 4096, (4096, 1024, 1024), (16, 16, 16), (2.0, 2.0, 2.0), torch.bfloat16, device="cuda")
    x = torch.randn(2048, 4096, device="cuda").bfloat16().requires_grad_()
    x_ref, twins = fp32_twin(x, projections)
    ys_ref = separate_fp32(x_ref, twins)
    grads = [torch.randn_like(y) for y in ys_ref]
    torch.autograd.backward(ys_ref, grads)
    leaves = leaves_of(x, projections)
    refs = [y.detach() for y in ys_ref] + [t.grad for t in leaves_of(x_ref, twins)]
    results = []
    for op in (lora_linear_group, lora_linear_group_ref):
        ys = op(x, projections)
        results.append([y.detach() for y in ys] + list(torch.autograd.grad(ys, leaves, [g.bfloat16() for g in grads])))
    names = [f"y{i}" for i in range(3)] + names_of(projections)
    for name, got, plain, ref in zip(names, *results, refs):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2 and err < 1.2 * (plain.float() - ref).norm() / ref.norm() + 1e-4, (name, err.item())
