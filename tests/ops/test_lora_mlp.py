"""``ops/lora_mlp.py`` (a SwiGLU MLP of three LoRA projections as one op, each LoRA term inside its matmul) against
fp32 autograd of the plain composition; its windows, what it keeps for backward, and the LoRA delta that an unfused
bf16 forward rounds away."""

from __future__ import annotations

import importlib

import pytest
import torch

from peft_fastlora.ops import LoraProjection, fastlora_linear, lora_mlp, lora_mlp_fusable
from peft_fastlora.ops.lora_mlp import lora_mlp_ref
from peft_fastlora.ops.reference import silu_mul_ref
from tests.utils import saved_bytes

from .helpers import assert_close_scaled, make_weight, record_windows

DTYPE_CASES = [  # (x dtype, adapter dtype, atol, rtol) against fp32 autograd, as in test_swiglu_lora.py
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.float16, torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 3e-2, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 3e-2, id="bf16-fp32adapters"),
]
NAMES = ("x", "gate.lora_a", "gate.lora_b", "up.lora_a", "up.lora_b", "down.lora_a", "down.lora_b")


def projection(kind, n, k, r, scaling, adapter_dtype, device="cpu", b_std=None):
    """A projection with a fresh random weight and adapter (B ~ N(0, 1/r) unless ``b_std``: never zero, which
    would hide the LoRA term)."""
    a = (torch.randn(r, k, device=device) / k**0.5).to(adapter_dtype).requires_grad_()
    b = (torch.randn(n, r, device=device) * (b_std if b_std is not None else r**-0.5)).to(adapter_dtype)
    return LoraProjection(make_weight(kind, n, k, device=device), a, b.requires_grad_(), scaling)


def mlp(kind, hidden, inter, adapter_dtype, ranks=(8, 8, 8), scalings=(2.0, 2.0, 2.0), device="cpu"):
    return (projection(kind, inter, hidden, ranks[0], scalings[0], adapter_dtype, device),
            projection(kind, inter, hidden, ranks[1], scalings[1], adapter_dtype, device),
            projection(kind, hidden, inter, ranks[2], scalings[2], adapter_dtype, device))  # fmt: skip


def leaves_of(x, projections):
    return [x] + [t for p in projections for t in (p.lora_a, p.lora_b)]


def fp32_twin(x, projections):
    """Detached fp32 copies of ``x`` and the adapters, as new leaves, and the projections holding them."""
    leaves = [t.detach().float().requires_grad_() for t in leaves_of(x, projections)]
    twins = tuple(LoraProjection(p.weight, leaves[1 + 2 * i], leaves[2 + 2 * i], p.scaling)
                  for i, p in enumerate(projections))  # fmt: skip
    return leaves[0], twins, leaves


CASES = [  # (lead, hidden, intermediate, kind, ranks, scalings): whole absmax blocks per row (what fuses)
    ((5,), 64, 128, "nf4-nested", (8, 8, 8), (2.0, 2.0, 2.0)),
    ((2, 7), 128, 192, "int8", (4, 12, 8), (0.5, 2.0, 1.0)),  # gate and up with their own rank and scaling
    ((3,), 128, 256, "fp4-128", (8, 8, 16), (2.0, 2.0, 0.25)),
]


@pytest.mark.parametrize("lead, hidden, inter, kind, ranks, scalings", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_fused_matches_fp32_autograd(force_triton, lead, hidden, inter, kind, ranks, scalings, x_dtype,
                                     adapter_dtype, atol, rtol):  # fmt: skip
    projections = mlp(kind, hidden, inter, adapter_dtype, ranks, scalings)
    assert lora_mlp_fusable(*projections)
    x = torch.randn(*lead, hidden).to(x_dtype).requires_grad_()
    y = lora_mlp(x, *projections)
    down_node = y.grad_fn.next_functions[0][0]
    assert type(down_node).__name__ == "SwiGLUDownFunctionBackward"
    assert "LoraGateUpFunctionBackward" in {type(f).__name__ for f, _ in down_node.next_functions if f is not None}
    x_ref, twins, ref_leaves = fp32_twin(x, projections)
    y_ref = lora_mlp_ref(x_ref, *twins)
    assert y.dtype == x_dtype and y.shape == y_ref.shape
    assert_close_scaled(y, y_ref, atol, rtol, "y")
    grad = torch.randn_like(y_ref)
    y.backward(grad.to(y.dtype))
    y_ref.backward(grad)
    for name, t, ref in zip(NAMES, leaves_of(x, projections), ref_leaves):
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert_close_scaled(t.grad, ref.grad, atol, rtol, f"d{name}")


def test_windows_give_the_same_result(force_triton, monkeypatch):
    """Under checkpointing, inside the backward pass (the forward that checkpointing recomputes, and the input grads)
    weights are cut into row windows (forward) and column windows (backward), each next to its slice of the adapter
    factors; the first forward makes them whole, and so does every pass without checkpointing. Either way the result
    is what whole weights give."""
    projections = mlp("nf4-nested", 128, 256, torch.float32, ranks=(4, 8, 8))
    x = torch.randn(6, 128, requires_grad=True)
    grad = torch.randn(6, 128)

    def run(checkpointed: bool):
        for t in leaves_of(x, projections):
            t.grad = None
        if checkpointed:
            y = torch.utils.checkpoint.checkpoint(lora_mlp, x, *projections, use_reentrant=False)
        else:
            y = lora_mlp(x, *projections)
        y.backward(grad)
        return [y.detach()] + [t.grad.clone() for t in leaves_of(x, projections)]

    module = importlib.import_module("peft_fastlora.ops.lora_mlp")  # (the package's `lora_mlp` is the function)
    outside, inside = record_windows(monkeypatch, module)
    whole = run(False)
    # without checkpointing the peak is elsewhere: W whole, forward and backward
    assert len(outside) == 3 and len(inside) == 2 and all(len(w) == 1 for w in outside + inside)
    outside.clear()
    inside.clear()
    windowed = run(True)
    assert outside and all(len(w) == 1 for w in outside)  # the first forward: W whole
    # the recomputed forward's gate, up and down, then dh and dx: each cut
    assert len(outside) == 3 and len(inside) == 5 and all(len(w) >= 2 for w in inside)
    for name, got, expected in zip(("y",) + NAMES, windowed, whole):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_keeps_x_once_and_never_h(force_triton):
    """Backward gets ``[x | x A.T]`` (x once, for gate and up), gate, up, the down projection's ``h A.T`` and the
    adapters; never ``h = silu(gate) * up`` and no second copy of x."""
    rows, hidden, inter = 16, 64, 128
    projections = mlp("nf4-nested", hidden, inter, torch.float32, ranks=(8, 4, 8))
    x = torch.randn(rows, hidden, requires_grad=True)
    adapters = sum(t.nbytes for p in projections for t in (p.lora_a, p.lora_b))
    xc = rows * (hidden + 8 + 4) * 4
    expected = xc + 2 * rows * inter * 4 + rows * 8 * 4 + adapters
    assert saved_bytes(lambda: lora_mlp(x, *projections)) == expected


def test_a_lora_delta_below_half_an_ulp_is_not_rounded_away(force_triton):
    """Early in training (B starts at zero) the LoRA term is far smaller than the base output. An unfused bf16
    projection rounds the base product to bf16 first, and then adding a delta under half a bf16 ulp rounds back to
    the same value: the adapter has no effect on the forward at all. Inside the fused matmul the delta is summed in
    fp32 with the unrounded base, so the rounded output moves with it: on average by the delta itself."""
    torch.manual_seed(0)
    rows, hidden, inter = 64, 128, 256
    gate, up, down = mlp("nf4-nested", hidden, inter, torch.bfloat16)
    x = torch.randn(rows, hidden).bfloat16()
    tiny = (torch.randn(hidden, 8) * 3e-5).bfloat16()  # the down projection's B after a few steps from zero

    def moved(op):  # how far the output moves when B goes from zero to `tiny`
        with torch.no_grad():
            outputs = [op(x, gate, up, LoraProjection(down.weight, down.lora_a, b, down.scaling))
                       for b in (tiny, torch.zeros_like(tiny))]  # fmt: skip
        return (outputs[0].float() - outputs[1].float()).flatten()

    with torch.no_grad():  # the delta itself, in fp32, on the h of the unfused forward
        g = fastlora_linear(x, gate.weight, None, gate.lora_a, gate.lora_b, gate.scaling)
        u = fastlora_linear(x, up.weight, None, up.lora_a, up.lora_b, up.scaling)
        xa = silu_mul_ref(g, u).float() @ down.lora_a.float().t()
        delta = (down.scaling * xa @ tiny.float().t()).flatten()
    assert delta.abs().max() < 5e-3  # under half a bf16 ulp (outputs here are ~2.7 on average, ulp 2^-6)
    fused, unfused = moved(lora_mlp), moved(lora_mlp_ref)

    def slope(moved):  # least squares: moved ~= slope * delta
        return ((moved * delta).sum() / (delta * delta).sum()).item()

    assert unfused.count_nonzero() < 0.1 * delta.numel() and slope(unfused) < 0.3  # the unfused forward drops it
    assert 0.7 < slope(fused) < 1.3, slope(fused)


def test_falls_back_to_the_composition(reference_path, force_triton):
    """Rows that are not whole absmax blocks do not fuse (the weight windows could not take the adapter factors);
    the op then is the plain composition, with the same result."""
    projections = mlp("nf4-nested", 64, 96, torch.float32)  # 96 = one and a half blocks of 64
    assert not lora_mlp_fusable(*projections)
    x = torch.randn(4, 64, requires_grad=True)
    y = lora_mlp(x, *projections)
    assert "Function" not in str(y.grad_fn.next_functions)
    torch.testing.assert_close(y, lora_mlp_ref(x, *projections))


def test_reference_path_on_cpu(reference_path):
    projections = mlp("nf4-nested", 64, 128, torch.float32)
    x = torch.randn(4, 64, requires_grad=True)
    y = lora_mlp(x, *projections)
    assert "SwiGLUDown" not in str(y.grad_fn.next_functions)
    torch.testing.assert_close(y, lora_mlp_ref(x, *projections))


def test_bad_projections_are_named(force_triton):
    gate, up, down = mlp("nf4-nested", 64, 128, torch.float32)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weights must be"):
        lora_mlp(x, gate, up, gate)
    with pytest.raises(ValueError, match="`up` has no adapter"):
        lora_mlp(x, gate, LoraProjection(up.weight, None, None, 1.0), down)
    with pytest.raises(TypeError, match="`down` must be a LoraProjection"):
        lora_mlp(x, gate, up, (down.weight, down.lora_a, down.lora_b, 1.0))
    with pytest.raises(ValueError, match="in_features=64"):
        lora_mlp(torch.randn(4, 32), gate, up, down)


def test_autocast_runs_the_op_in_the_autocast_dtype(force_triton):
    gate, up, down = mlp("nf4-nested", 64, 128, torch.float32)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_mlp(x, gate, up, down)
        assert torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, lora_mlp(x.bfloat16(), gate, up, down), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
def test_gpu_fused_matches_fp32_at_llama_shape(kind):
    """A Llama-3-8B MLP (4096 -> 14336 -> 4096) over 2048 tokens in bf16, r=16: output and every grad within bf16
    rounding of fp32 autograd, and no further from it than the unfused composition in bf16."""
    torch.manual_seed(0)
    projections = mlp(kind, 4096, 14336, torch.bfloat16, ranks=(16, 16, 16), device="cuda")
    x = torch.randn(2048, 4096, device="cuda").bfloat16().requires_grad_()
    x_ref, twins, ref_leaves = fp32_twin(x, projections)
    y_ref = lora_mlp_ref(x_ref, *twins)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    leaves = leaves_of(x, projections)
    fused = [lora_mlp(x, *projections)]
    fused += torch.autograd.grad(fused[0], leaves, grad.bfloat16())
    unfused = [lora_mlp_ref(x, *projections)]
    unfused += torch.autograd.grad(unfused[0], leaves, grad.bfloat16())
    for name, got, plain, ref in zip(("y",) + NAMES, fused, unfused, [y_ref] + [t.grad for t in ref_leaves]):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2 and err < 1.2 * (plain.float() - ref).norm() / ref.norm(), (name, err.item())


def test_gate_and_up_are_freed_before_the_matmul_with_both_weights(force_triton, monkeypatch):
    """Two ops, so that autograd frees gate and up (kept by the down projection's op) before the gate / up backward
    dequantizes both weights next to ``[d gate | d up]``: one op would hold them to its end, two activations more at
    that point. The grads of gate and up reach it as the buffer they were written into, not a copy."""
    import weakref

    module = importlib.import_module("peft_fastlora.ops.lora_mlp")
    projections = mlp("nf4-nested", 64, 128, torch.float32)
    x = torch.randn(8, 64, requires_grad=True)
    made, alive, wide = [], [], []
    real_forward, real_grad, real_wide = module.gate_up_forward, module.concat_input_grad, module._wide_grad

    def gate_up_forward(*args):
        out = real_forward(*args)
        made.extend(weakref.ref(t) for t in out[:2])
        return out

    def concat_input_grad(g, weights, *args, **kwargs):
        if len(weights) == 2:
            alive.append([ref() is not None for ref in made])
        return real_grad(g, weights, *args, **kwargs)

    def wide_grad(d_gate, d_up, extra):
        d = real_wide(d_gate, d_up, extra)
        wide.append(d.data_ptr() == d_gate.data_ptr())
        return d

    monkeypatch.setattr(module, "gate_up_forward", gate_up_forward)
    monkeypatch.setattr(module, "concat_input_grad", concat_input_grad)
    monkeypatch.setattr(module, "_wide_grad", wide_grad)
    lora_mlp(x, *projections).sum().backward()
    assert alive == [[False, False]] and wide == [True]


def test_wide_grad_copies_what_is_not_its_own_buffer():
    module = importlib.import_module("peft_fastlora.ops.lora_mlp")
    d = torch.randn(4, 2 * 6 + 3)
    same = module._wide_grad(d[:, :6], d[:, 6:12], 3)
    assert same.data_ptr() == d.data_ptr() and same.shape == d.shape
    dg, du = torch.randn(4, 6), torch.randn(4, 6)
    copy = module._wide_grad(dg, du, 3)
    assert copy.shape == (4, 15) and torch.equal(copy[:, :6], dg) and torch.equal(copy[:, 6:12], du)
    swapped = module._wide_grad(d[:, 6:12], d[:, :6], 3)  # adjacent the other way round: not its layout
    assert swapped.data_ptr() != d.data_ptr() and torch.equal(swapped[:, :6], d[:, 6:12])
