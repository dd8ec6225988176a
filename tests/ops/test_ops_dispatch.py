"""Dispatch rules of ``peft_fastlora.ops.fastlora_linear`` / ``dequantize``, and the ``torch.library`` custom ops.

CPU tensors take the reference path unless ``PEFT_FASTLORA_FORCE_TRITON=1``, which runs the Triton path under the
interpreter (and, under ``torch.compile``, the custom ops).
"""

from __future__ import annotations

import pytest
import torch

from peft_fastlora import ops
from peft_fastlora.ops import custom_ops, fastlora_linear
from peft_fastlora.ops.quant_state import Packed4bit
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

from .test_lora_linear import assert_close_scaled, make_inputs, make_weight, skip_unless_interpreted

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Tolerances (relative to the output magnitude) for the worst of x/adapter dtypes in a comparison to fp32.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


@pytest.fixture(params=["reference", "triton"])
def path(request, monkeypatch):
    if request.param == "triton":
        skip_unless_interpreted()
        monkeypatch.setenv("PEFT_FASTLORA_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    return request.param


@pytest.fixture
def force_triton(monkeypatch):
    skip_unless_interpreted()
    monkeypatch.setenv("PEFT_FASTLORA_FORCE_TRITON", "1")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _spy(monkeypatch, owner, name):
    """Replaces ``owner.name`` with a wrapper that records whether autocast was on at each call."""
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def _small_m_spy(monkeypatch):
    calls = []
    from peft_fastlora.ops import fused_small_m

    real = fused_small_m.small_m_forward

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(fused_small_m, "small_m_forward", spy)
    return calls


# ---- which implementation runs ---------------------------------------------------------------------------------------
def test_cpu_runs_reference(monkeypatch, path):
    weight = make_weight("nf4-nested", 40, 100)
    x, bias, lora_a, lora_b = make_inputs((2, 9), 40, 100, torch.bfloat16, torch.float32)
    ref_calls = _spy(monkeypatch, ops, "lora_linear_ref")
    y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    is_function = "LoraLinearFunction" in y.grad_fn.name()
    assert is_function == (path == "triton") and len(ref_calls) == (path == "reference")
    if path == "reference":  # the reference path is exactly lora_linear_ref
        assert torch.equal(y, lora_linear_ref(x, weight, bias, lora_a, lora_b, 2.0))


def test_small_m_without_grad_runs_fused_kernel(monkeypatch, force_triton):
    weight = make_weight("nf4", 40, 100)
    m_max = ops.small_m_max()
    calls = _small_m_spy(monkeypatch)
    x, bias, lora_a, lora_b = make_inputs((m_max,), 40, 100, torch.float16, torch.float16)
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
    weight = make_weight("nf4-nested", 48, 96)
    x, bias, lora_a, lora_b = make_inputs((2, 5), 48, 96, x_dtype, adapter_dtype)
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
    weight = make_weight("int8", 40, 100)
    x, bias, lora_a, lora_b = make_inputs((7,), 40, 100, torch.float32, torch.float32)
    y1 = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    (g1,) = torch.autograd.grad(y1.sum(), x)
    y2 = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0, lora_x=x)
    (g2,) = torch.autograd.grad(y2.sum(), x)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_autocast_casts_x_and_runs_without_autocast(monkeypatch, path, x_dtype):
    weight = make_weight("nf4-nested", 40, 100)
    x, bias, lora_a, lora_b = make_inputs((3, 4), 40, 100, x_dtype, torch.float32)
    lora_x = (x * 0.5).detach().requires_grad_()
    inner = "lora_linear_ref" if path == "reference" else "LoraLinearFunction"
    calls = _spy(monkeypatch, ops, inner) if path == "reference" else _spy(monkeypatch, ops.LoraLinearFunction, "apply")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0, lora_x)
    assert calls == [False], f"{inner} must run with autocast disabled"
    assert y.dtype == torch.bfloat16
    expected = fastlora_linear(x.bfloat16(), weight, bias, lora_a, lora_b, 2.0, lora_x.bfloat16())
    torch.testing.assert_close(y, expected, atol=0, rtol=0)
    y.float().sum().backward()
    assert x.grad.dtype == x_dtype and lora_x.grad.dtype == x_dtype and lora_a.grad.dtype == torch.float32


def test_dequantize_dispatch(path):
    for kind in ("nf4-nested", "int8"):
        weight = make_weight(kind, 40, 100)
        for dtype in FLOAT_DTYPES:
            assert torch.equal(ops.dequantize(weight, dtype), dequantize_ref(weight, dtype))
    with pytest.raises(TypeError, match="Packed4bit or Int8Rowwise"):
        ops.dequantize(torch.zeros(2, 2), torch.float32)


def test_weight_on_another_device_is_a_clear_error(path):
    weight = make_weight("nf4", 40, 100)
    meta = Packed4bit(**{**weight.__dict__, "data": weight.data.to("meta")})
    x = torch.randn(3, 100)
    with pytest.raises(ValueError, match="`weight` is on meta but `x` is on cpu"):
        fastlora_linear(x, meta, None, None, None, 1.0)


# ---- torch.compile and the custom ops --------------------------------------------------------------------------------
def _recording_backend(graphs):
    aot_eager = torch._dynamo.backends.registry.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    return backend


class _QLoraLinear(torch.nn.Module):
    """A minimal FastLoRA-like layer: quantized fields as buffers, the container built in ``forward``."""

    def __init__(self, weight, bias, lora_a, lora_b, separate_lora_x: bool = False):
        super().__init__()
        self.fields = {k: v for k, v in weight.__dict__.items() if not isinstance(v, torch.Tensor)}
        for name, value in weight.__dict__.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.lora_a = torch.nn.Parameter(lora_a.detach())
        self.lora_b = torch.nn.Parameter(lora_b.detach())
        self.separate_lora_x = separate_lora_x  # a deterministic stand-in for dropout on the LoRA branch

    def forward(self, x):
        weight = Packed4bit(
            data=self.data,
            absmax=self.absmax,
            code=self.code,
            nested_absmax=getattr(self, "nested_absmax", None),
            nested_code=getattr(self, "nested_code", None),
            offset=getattr(self, "offset", None),
            **self.fields,
        )
        lora_x = x * 0.5 if self.separate_lora_x else None
        return fastlora_linear(x, weight, self.bias, self.lora_a, self.lora_b, 2.0, lora_x)


def _module_and_input(x_dtype=torch.float32, separate_lora_x=False, device="cpu", n=40, k=100, lead=(2, 3)):
    weight = make_weight("nf4-nested", n, k, device=device)
    x, bias, lora_a, lora_b = make_inputs(lead, n, k, x_dtype, torch.float32, device=device)
    return _QLoraLinear(weight, bias, lora_a, lora_b, separate_lora_x).to(device), x


def _grads(module, x):
    return [x.grad] + [p.grad for p in (module.lora_a, module.lora_b)]


def _check_compiled_matches_eager(module, x, compiled, tol=1e-5):
    """Compiled forward and grads equal eager ones up to ``tol`` (relative to each tensor's largest value)."""
    y_eager = module(x)
    y_eager.float().square().sum().backward()
    eager_grads = _grads(module, x)
    x.grad = module.lora_a.grad = module.lora_b.grad = None
    y = compiled(x)
    y.float().square().sum().backward()
    assert y.dtype == x.dtype
    assert_close_scaled(y, y_eager, tol, tol, "y")
    for name, got, want in zip(("dx", "dA", "dB"), _grads(module, x), eager_grads):
        assert got is not None and got.dtype == want.dtype
        assert_close_scaled(got, want, tol, tol, name)


def test_compile_fullgraph_reference_path(fresh_dynamo, monkeypatch):
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    module, x = _module_and_input()
    _check_compiled_matches_eager(module, x, torch.compile(module, fullgraph=True, backend="eager"))


@pytest.mark.parametrize("separate_lora_x", [False, True])
def test_compile_fullgraph_custom_op(fresh_dynamo, force_triton, separate_lora_x):
    module, x = _module_and_input(separate_lora_x=separate_lora_x)
    graphs = []
    compiled = torch.compile(module, fullgraph=True, backend=_recording_backend(graphs))
    _check_compiled_matches_eager(module, x, compiled)
    assert len(graphs) == 1 and "peft_fastlora.lora_linear" in graphs[0]
    with torch.no_grad():  # decode shape without grad: the fused small-M op
        y = compiled(x[0, :1])
    torch.testing.assert_close(y, module(x[0, :1]), atol=1e-5, rtol=1e-5)
    assert "peft_fastlora.lora_linear_small_m" in graphs[-1]


def test_compile_fullgraph_under_autocast(fresh_dynamo, force_triton):
    module, x = _module_and_input()

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(x)

    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, step(x), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["nf4-nested", "fp4-nested-bf16storage", "int8"])
def test_opcheck_custom_ops(force_triton, kind):
    weight = make_weight(kind, 40, 100)
    fields = custom_ops.flatten_weight(weight)
    x, bias, lora_a, lora_b = make_inputs((2, 3), 40, 100, torch.float32, torch.float32)
    bias.requires_grad_()
    lora_x = torch.randn_like(x).requires_grad_()
    cases = [
        (x, bias, lora_a, lora_b, None, 0.5, *fields),
        (x, None, lora_a, lora_b, lora_x, 2.0, *fields),
        (x, bias, None, None, None, 1.0, *fields),
    ]
    for args in cases if kind == "nf4-nested" else cases[:1]:  # the argument variants once; each weight kind once
        torch.library.opcheck(custom_ops.lora_linear_op, args)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(custom_ops.lora_linear_small_m_op, detached)
    torch.library.opcheck(custom_ops.dequantize_op, (torch.bfloat16, *fields))
    assert torch.equal(custom_ops.dequantize_op(torch.float16, *fields), dequantize_ref(weight, torch.float16))


# ---- GPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_gpu_compile_inductor_fullgraph(fresh_dynamo, x_dtype):
    module, x = _module_and_input(x_dtype, separate_lora_x=True, device="cuda", n=1024, k=768, lead=(4, 64))
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    _check_compiled_matches_eager(module, x, compiled, tol=1e-2)
    with torch.no_grad():
        x_decode = x[:, :1].detach()
        assert_close_scaled(compiled(x_decode), module(x_decode), 1e-2, 1e-2, "decode")


@pytest.mark.gpu
def test_gpu_opcheck_custom_ops():
    weight = make_weight("nf4-nested", 384, 256, device="cuda")
    fields = custom_ops.flatten_weight(weight)
    x, bias, lora_a, lora_b = make_inputs((2, 40), 384, 256, torch.bfloat16, torch.float32, device="cuda")
    torch.library.opcheck(custom_ops.lora_linear_op, (x, bias, lora_a, lora_b, (x * 0.5).detach(), 0.5, *fields))
    detached = (x[:, :3].detach(), bias, lora_a.detach(), lora_b.detach(), None, 0.5, *fields)
    torch.library.opcheck(custom_ops.lora_linear_small_m_op, detached)
    torch.library.opcheck(custom_ops.dequantize_op, (torch.float16, *fields))


@pytest.mark.gpu
def test_gpu_cuda_dispatch():
    weight = make_weight("nf4-nested", 256, 384, device="cuda")
    x, bias, lora_a, lora_b = make_inputs((2, 40), 256, 384, torch.bfloat16, torch.float32, device="cuda")
    y = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    assert "LoraLinearFunction" in y.grad_fn.name() and y.dtype == torch.bfloat16
    with torch.autocast("cuda", dtype=torch.float16):
        y16 = fastlora_linear(x, weight, bias, lora_a, lora_b, 2.0)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), y.float(), atol=5e-2, rtol=5e-2)
    assert ops.dequantize(weight, torch.bfloat16).is_cuda


def test_compile_fullgraph_reads_the_tuned_crossover(fresh_dynamo, force_triton, monkeypatch):
    """Under torch.compile the crossover lookup (which asks CUDA for the GPU's name, a str) is a trace-time constant;
    the table is still honoured: with a crossover of 2 rows, 2 rows take the fused op and 3 rows the autograd op."""
    from peft_fastlora.ops import fused_small_m, tuned

    def device_table(device):
        torch._dynamo.graph_break()  # untraceable, like torch.cuda.get_device_name (returns a str) on the GPU
        return {"kinds": {"nf4": {"40x100": {"crossover_m": 2, "configs": {}}}}}

    monkeypatch.setattr(tuned, "_device_table", device_table)
    fused_small_m._small_m_limit_cached.cache_clear()
    try:
        module, x = _module_and_input()
        graphs = []
        compiled = torch.compile(module, fullgraph=True, backend=_recording_backend(graphs))
        with torch.no_grad():
            for rows, op in ((2, "peft_fastlora.lora_linear_small_m"), (3, "peft_fastlora.lora_linear.default")):
                y = compiled(x[0, :rows])
                torch.testing.assert_close(y, module(x[0, :rows]), atol=1e-5, rtol=1e-5)
                assert op in graphs[-1], (rows, graphs[-1])
    finally:
        fused_small_m._small_m_limit_cached.cache_clear()
