"""``ops/lora_linear.py``: ``LoraLinearFunction`` (dequantize + cuBLAS training path) against an fp32
``lora_linear_ref`` with torch autograd.

On CPU the Function runs with the interpreted Triton dequant (the ``force_triton`` fixture) on small shapes; the
``gpu`` tests use Llama-3-8B shapes through the door.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from peft_fastlora.ops import LoraLinearFunction, fastlora_linear, kernels
from peft_fastlora.ops import lora_linear as lora_linear_module
from peft_fastlora.ops.lora_linear import weight_windows
from peft_fastlora.ops.reference import lora_linear_ref

from .helpers import assert_close_scaled, make_inputs, make_weight

# (x dtype, adapter dtype, atol, rtol); atol is relative to the largest reference value (see `assert_close_scaled`).
DTYPE_CASES = [
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.float16, torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.float16, torch.float32, 5e-3, 5e-3, id="fp16-fp32adapters"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 3e-2, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 3e-2, id="bf16-fp32adapters"),
]
WEIGHT_KINDS = ["nf4", "nf4-nested", "fp4-nested-bf16storage", "int8"]
# (leading dims of x, out_features N, in_features K): M=1, 3-D input, K not a multiple of the block, odd N.
SHAPES = [((1,), 40, 100), ((2, 3), 72, 96), ((17,), 48, 130)]


def function(x, weight, bias, lora_a, lora_b, scaling, lora_x):
    """``LoraLinearFunction`` called with the public argument order (the Function takes the weight last)."""
    return LoraLinearFunction.apply(x, bias, lora_a, lora_b, scaling, lora_x, weight)


def inputs(lead, n, k, x_dtype, adapter_dtype, **kwargs):
    x, bias, lora_a, lora_b, _ = make_inputs(lead, n, k, x_dtype, adapter_dtype, requires_grad=True, **kwargs)
    return x, bias, lora_a, lora_b


def fp32_leaf(t):
    return None if t is None else t.detach().float().requires_grad_(t.requires_grad)


def run_and_compare(x, weight, bias, lora_a, lora_b, scaling, lora_x, atol, rtol, fn=function):
    """Runs ``fn`` forward + backward and compares output and every grad with fp32 reference autograd.

    ``lora_x`` may be a tensor (a leaf of its own) or a function of ``x`` (e.g. a fixed dropout mask), applied to
    ``x`` and to its fp32 copy alike.
    """
    lora_x_fn = lora_x if callable(lora_x) else None
    leaves = {"x": x, "bias": bias, "lora_a": lora_a, "lora_b": lora_b, "lora_x": None if lora_x_fn else lora_x}
    ref = {name: fp32_leaf(t) for name, t in leaves.items()}
    if lora_x_fn:
        lora_x, ref["lora_x"] = lora_x_fn(x), lora_x_fn(ref["x"])
    y = fn(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    y_ref = lora_linear_ref(ref["x"], weight, ref["bias"], ref["lora_a"], ref["lora_b"], scaling, ref["lora_x"])
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert_close_scaled(y, y_ref, atol, rtol, "y")
    grad = torch.randn_like(y_ref)
    y.backward(grad.to(y.dtype))
    y_ref.backward(grad)
    for name, t in leaves.items():
        if t is None:
            continue
        if not t.requires_grad:
            assert t.grad is None, f"{name} must not get a grad"
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, f"{name}.grad must exist in {t.dtype}"
        assert_close_scaled(t.grad, ref[name].grad, atol, rtol, f"d{name}")
    return y


@pytest.mark.parametrize("lead, n, k", SHAPES)
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_forward_and_grads_match_fp32_reference(force_triton, lead, n, k, kind, x_dtype, adapter_dtype, atol, rtol):
    weight = make_weight(kind, n, k)
    x, bias, lora_a, lora_b = inputs(lead, n, k, x_dtype, adapter_dtype)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, atol, rtol)


@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_separate_lora_input(force_triton, x_dtype, adapter_dtype, atol, rtol):
    """Dropout on the LoRA branch: grads reach x through both branches, and an independent lora_x gets its own."""
    weight = make_weight("nf4-nested", 56, 96)
    x, bias, lora_a, lora_b = inputs((3, 5), 56, 96, x_dtype, adapter_dtype)
    keep = (torch.rand(x.shape) > 0.3).to(x_dtype) / 0.7

    def dropout(t):
        return t * keep.to(t.dtype)

    run_and_compare(x, weight, bias, lora_a, lora_b, 0.5, dropout, atol, rtol)
    x.grad = lora_a.grad = lora_b.grad = None
    lora_x = torch.randn_like(x).requires_grad_()
    run_and_compare(x, weight, bias, lora_a, lora_b, 0.5, lora_x, atol, rtol)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_no_lora_and_trainable_bias(force_triton, kind, x_dtype, adapter_dtype, atol, rtol):
    weight = make_weight(kind, 40, 100)
    x, bias, lora_a, lora_b = inputs((2, 7), 40, 100, x_dtype, adapter_dtype)
    fp32_bias = bias.detach().float().requires_grad_()  # fp32 bias with 16-bit x: its grad comes back in fp32
    run_and_compare(x, weight, fp32_bias, lora_a, lora_b, 2.0, None, atol, rtol)
    x.grad = None
    run_and_compare(x, weight, bias.detach().clone().requires_grad_(), None, None, 1.0, None, atol, rtol)
    x.grad = None
    run_and_compare(x, weight, None, None, None, 1.0, None, atol, rtol)


@pytest.mark.parametrize("lead", [(6,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_output_may_be_modified_in_place(force_triton, lead, with_bias):
    """``y += residual`` on the output, as on nn.Linear's: allowed (not a view made inside the Function), with the
    gradients of the same sum taken out of place."""
    weight = make_weight("nf4", 40, 96)
    x, bias, lora_a, lora_b = inputs(lead, 40, 96, torch.float32, torch.float32, bias=with_bias)
    residual = torch.randn(*lead, 40, requires_grad=True)
    grad = torch.randn(*lead, 40)
    results = []
    for in_place in (True, False):
        leaves = [t for t in (x, bias, lora_a, lora_b, residual) if t is not None and t.requires_grad]
        y = function(x, weight, bias, lora_a, lora_b, 2.0, None)
        assert not y._is_view()
        if in_place:
            y += residual
        else:
            y = y + residual
        results.append((y.detach(), torch.autograd.grad(y, leaves, grad)))
    (y_in, grads_in), (y_out, grads_out) = results
    torch.testing.assert_close(y_in, y_out, atol=0, rtol=0)
    for got, expected in zip(grads_in, grads_out, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        assert got.abs().sum() > 0


def test_skips_unneeded_grads(force_triton, monkeypatch):
    """A frozen input (first layer) never re-dequantizes W; frozen adapters get no grad and no work."""
    calls = []
    dequant = kernels.load().dequant
    real = dequant.dequantize_triton

    def counting(weight, dtype, out=None):
        calls.append(dtype)
        return real(weight, dtype, out)

    monkeypatch.setattr(dequant, "dequantize_triton", counting)
    weight = make_weight("nf4", 40, 100)
    x, bias, lora_a, lora_b = inputs((6,), 40, 100, torch.float32, torch.float32)
    x.requires_grad_(False)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, 1e-4, 1e-4)
    assert len(calls) == 1, "backward must not dequantize W when x needs no grad"

    calls.clear()
    lora_a.grad = lora_b.grad = None
    x.requires_grad_()
    lora_a.requires_grad_(False)
    lora_b.requires_grad_(False)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, 1e-4, 1e-4)
    assert len(calls) == 2


@pytest.mark.parametrize("via_dispatch", [False, True])
def test_forward_does_not_save_dequantized_weight(force_triton, via_dispatch):
    n = k = 128
    weight = make_weight("nf4-nested", n, k)
    x, bias, lora_a, lora_b = inputs((4,), n, k, torch.bfloat16, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    fn = fastlora_linear if via_dispatch else function
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, weight, bias, lora_a, lora_b, 2.0, None)
    assert saved, "the LoRA branch input and xa must be saved"
    assert all(t.numel() < n * k for t in saved), [tuple(t.shape) for t in saved]
    y.sum().backward()


QUARTERS = {4096: [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)],
            14336: [(0, 3584), (3584, 7168), (7168, 10752), (10752, 14336)]}


@pytest.mark.parametrize(("m", "n", "k", "length", "expected"), [
    (2048, 4096, 14336, 4096, QUARTERS[4096]),  # down projection at 2048 tokens, forward (W's rows): W is 2x x
    (2048, 4096, 14336, 14336, QUARTERS[14336]),  # ... its dx (W's columns)
    (2048, 14336, 4096, 14336, QUARTERS[14336]),  # up projection, forward: 7x x, at most 4 windows
    (2048, 14336, 4096, 4096, QUARTERS[4096]),
    (8192, 14336, 4096, 4096, QUARTERS[4096]),  # at 8192 tokens: W is still 1.75x x
    (8192, 4096, 14336, 14336, [(0, 14336)]),  # the activation is larger than W: whole
    (2048, 4096, 4096, 4096, [(0, 4096)]),  # q/o projection: 32 MiB, not cut
    (2048, 1024, 4096, 1024, [(0, 1024)]),
    (1, 14336, 4096, 2048, [(0, 1024), (1024, 2048)]),  # at least MIN_WINDOW wide
    (1, 14336, 4096, 2000, [(0, 2000)]),
])  # fmt: skip
def test_weight_windows(m, n, k, length, expected):
    assert weight_windows(m, n, k, length, 64, 2) == expected
    assert weight_windows(m, n, k, length, 0, 2) == [(0, length)]  # a weight without windows


def test_weight_windows_sizes(monkeypatch):
    monkeypatch.setattr(lora_linear_module, "MIN_WINDOW", 10)
    monkeypatch.setattr(lora_linear_module, "MIN_WINDOW_BYTES", 400)
    assert weight_windows(4, 100, 30, 30, 1, 4) == [(0, 10), (10, 20), (20, 30)]  # 100 floor, 3 x 10 columns
    assert weight_windows(0, 100, 30, 100, 8, 4) == [(0, 32), (32, 64), (64, 96), (96, 100)]  # 4 windows, aligned
    assert weight_windows(100, 100, 30, 100, 1, 4) == [(0, 50), (50, 100)]  # half the activation
    assert weight_windows(0, 100, 30, 100, 8, 4, max_windows=2) == [(0, 56), (56, 100)]  # a caller's own cap
    assert weight_windows(0, 100, 30, 100, 8, 4, max_windows=1) == [(0, 100)]


def test_fused_ops_cut_the_weight_only_where_checkpointing_puts_the_peak(monkeypatch):
    """The fused ops' windows ``(forward, backward)``: whole outside gradient checkpointing, recording or not; in a
    checkpointed forward (under saved-tensor hooks) the backward is cut, the forward too while a CUDA graph records;
    a recompute (inside a backward pass, either kind of checkpointing) cuts both."""
    cap, most = lora_linear_module.fused_op_windows, lora_linear_module.MAX_WINDOWS
    assert cap() == (1, 1) == lora_linear_module.WHOLE
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", tuple(cap())))
            ctx.save_for_backward(x)  # (something for non-reentrant checkpointing to recompute)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            seen.append(("backward", tuple(cap())))
            return 2 * x * grad

    x = torch.randn(3, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [("forward", (1, 1)), ("backward", (most, most))]
    seen.clear()
    checkpoint(Probe.apply, x, use_reentrant=False).sum().backward()
    assert seen == [("forward", (1, most)), ("forward", (most, most)), ("backward", (most, most))]
    seen.clear()
    checkpoint(Probe.apply, x, use_reentrant=True).sum().backward()
    assert seen == [("forward", (1, 1)), ("forward", (most, most)), ("backward", (most, most))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cap() == (1, 1)  # recording a step without checkpointing
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert cap() == (most, most)  # recording a checkpointed forward
    with lora_linear_module.kept_under_checkpointing():
        assert cap() == (most, most)  # recording the block that checkpointing keeps
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert cap() == (1, most)  # its eager forward
    assert cap() == (1, 1)


@pytest.mark.parametrize("kind, n, k", [
    ("nf4-nested", 200, 256), ("int8", 190, 130), ("fp4-nested-bf16storage", 160, 192), ("nf4", 200, 130)
])  # fmt: skip
@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES[:2] + DTYPE_CASES[4:])
@pytest.mark.parametrize("windowed", [True, False], ids=["windows", "plain-layer"])
def test_weight_in_windows(force_triton, monkeypatch, kind, n, k, x_dtype, adapter_dtype, atol, rtol, windowed):
    """With W larger than the activation and windows allowed (the fused ops' default, ``MAX_WINDOWS``), forward
    dequantizes it in row windows and backward (dx) in column windows, each matmul writing its part of the result
    (bias included); output and grads still match the fp32 reference. nf4 with K = 130 (rows not whole blocks) takes
    the whole weight. A plain layer's Function (``PLAIN_LAYER_WINDOWS``) makes W whole."""
    monkeypatch.setattr(lora_linear_module, "MIN_WINDOW", 64)
    monkeypatch.setattr(lora_linear_module, "MIN_WINDOW_BYTES", 64)
    if windowed:
        monkeypatch.setattr(lora_linear_module, "PLAIN_LAYER_WINDOWS", lora_linear_module.MAX_WINDOWS)
    dequant = kernels.load().dequant
    windows, real = [], dequant.dequantize_window

    made = []

    def spy(weight, dtype, rows, columns):
        assert all(ref() is None for ref in made), "a window is made while an earlier one is still alive"
        windows.append((rows, columns))
        out = real(weight, dtype, rows, columns)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(dequant, "dequantize_window", spy)
    weight = make_weight(kind, n, k)
    x, bias, lora_a, lora_b = inputs((3,), n, k, x_dtype, adapter_dtype)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, atol, rtol)
    if not dequant.column_alignment(weight) or not windowed:
        assert windows == []
        return
    size = x.element_size()
    rows = [((a, b), (0, k)) for a, b in weight_windows(3, n, k, n, lora_linear_module.ROW_WINDOW_ALIGN, size)]
    columns = [((0, n), (a, b)) for a, b in weight_windows(3, n, k, k, dequant.column_alignment(weight), size)]
    assert windows == rows + columns and len(rows) > 1 and len(columns) > 1


# ---- GPU ------------------------------------------------------------------------------------------------------------
LLAMA_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K): q/o proj, gate/up proj, down proj
GPU_CASES = [
    pytest.param("nf4-nested", torch.bfloat16, torch.float32, 2e-2, 2e-2, id="nf4nested-bf16-fp32adapters"),
    pytest.param("nf4", torch.float16, torch.float16, 4e-3, 4e-3, id="nf4-fp16"),
    pytest.param("fp4-nested-bf16storage", torch.float16, torch.float32, 4e-3, 4e-3, id="fp4-fp16-fp32adapters"),
    pytest.param("int8", torch.bfloat16, torch.bfloat16, 2e-2, 2e-2, id="int8-bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA_SHAPES)
@pytest.mark.parametrize("kind, x_dtype, adapter_dtype, atol, rtol", GPU_CASES)
def test_gpu_llama_shapes(n, k, kind, x_dtype, adapter_dtype, atol, rtol):
    weight = make_weight(kind, n, k, device="cuda")
    x, bias, lora_a, lora_b = inputs((2, 1024), n, k, x_dtype, adapter_dtype, r=16, device="cuda", bias=False)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, atol, rtol, fn=fastlora_linear)


@pytest.mark.gpu
def test_gpu_bf16_then_fp16_has_no_stale_state():
    """The same weights used in bf16, then fp16, then bf16 again (large and small M) give right results each time."""
    weight = make_weight("nf4-nested", 1024, 768, device="cuda")
    for x_dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        tol = 2e-2 if x_dtype == torch.bfloat16 else 4e-3
        for m in (1, 300):
            x, bias, lora_a, lora_b = inputs((m,), 1024, 768, x_dtype, torch.float32, device="cuda")
            run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, tol, tol, fn=fastlora_linear)
            with torch.no_grad():
                y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
                y_ref = lora_linear_ref(x.float(), weight, bias.float(), lora_a.float(), lora_b.float(), 2.0)
            assert y.dtype == x_dtype
            assert_close_scaled(y, y_ref, tol, tol, f"no-grad {x_dtype} M={m}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_second_device():
    weight = make_weight("nf4-nested", 512, 384, device="cuda:1")
    for m in (1, 256):
        x, bias, lora_a, lora_b = inputs((m,), 512, 384, torch.bfloat16, torch.float32, device="cuda:1")
        with torch.cuda.device(0):  # the current device is not the tensors' device
            y = run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, 2e-2, 2e-2, fn=fastlora_linear)
        assert y.device == torch.device("cuda:1") and x.grad.device == y.device


@pytest.mark.gpu
def test_gpu_forward_memory_grows_less_than_one_weight_per_layer():
    n = k = 4096
    m, n_layers = 256, 4
    layers = [make_weight("nf4-nested", n, k, device="cuda") for _ in range(n_layers)]
    adapters = [inputs((1,), n, k, torch.bfloat16, torch.float32, r=16, device="cuda")[2:] for _ in layers]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    h = x
    for weight, (lora_a, lora_b) in zip(layers, adapters):
        h = fastlora_linear(h, weight, None, lora_a, lora_b, 2.0)
    kept = torch.cuda.memory_allocated() - base
    w_bytes = n * k * 2
    assert kept < n_layers * w_bytes / 4, f"forward keeps {kept / 2**20:.0f} MiB for {n_layers} layers"
    assert torch.cuda.max_memory_allocated() - base < kept + 2 * w_bytes  # one W alive at a time
    h.float().pow(2).mean().backward()
    assert x.grad is not None and all(a.grad is not None for a, _ in adapters)


@pytest.mark.gpu
def test_gpu_large_weight_is_made_in_windows(monkeypatch):
    """The down projection at 2048 tokens: W (4096 x 14336, 112 MiB in bf16) is twice x, so forward and backward
    with windows allowed (the fused ops' default) each make it in four windows and never hold more than one."""
    monkeypatch.setattr(lora_linear_module, "PLAIN_LAYER_WINDOWS", lora_linear_module.MAX_WINDOWS)
    n, k, m = 4096, 14336, 2048
    weight = make_weight("nf4-nested", n, k, device="cuda")
    x, bias, lora_a, lora_b = inputs((m,), n, k, torch.bfloat16, torch.bfloat16, r=16, device="cuda", bias=False)
    w_bytes, x_bytes, y_bytes = n * k * 2, m * k * 2, m * n * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = function(x, weight, None, lora_a, lora_b, 2.0, None)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < y_bytes + 0.35 * w_bytes, f"forward grew by {grown / 2**20:.0f} MiB"
    grad = torch.randn_like(y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y.backward(grad)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < x_bytes + 0.35 * w_bytes, f"backward grew by {grown / 2**20:.0f} MiB"
    x_ref = x.detach().float().requires_grad_()
    y_ref = lora_linear_ref(x_ref, weight, None, lora_a.detach().float(), lora_b.detach().float(), 2.0, None)
    y_ref.backward(grad.float())
    assert_close_scaled(y, y_ref, 2e-2, 2e-2, "y")
    assert_close_scaled(x.grad, x_ref.grad, 2e-2, 2e-2, "dx")
