"""``ops/custom_ops.py``: the ``torch.library`` ops under ``torch.compile`` (no graph breaks, same results as eager),
``opcheck`` of every op, and the fields a weight crosses the op boundary as."""

from __future__ import annotations

import pytest
import torch

from peft_fastlora.ops import custom_ops, fastlora_linear, kernels
from peft_fastlora.ops.kernels import tuning
from peft_fastlora.ops.quant_state import weight_from_fields
from peft_fastlora.ops.reference import dequantize_ref

from .helpers import make_inputs, make_weight


def _recording_backend(graphs):
    aot_eager = torch._dynamo.backends.registry.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    return backend


class _QLoraLinear(torch.nn.Module):
    """A minimal FastLoRA-like layer: the weight's fields as buffers, the container rebuilt in ``forward``."""

    def __init__(self, weight, bias, lora_a, lora_b, separate_lora_x: bool = False):
        super().__init__()
        tensors, self.meta, self.quant_type = weight.to_fields()
        self.present = [t is not None for t in tensors]
        for i, t in enumerate(tensors):
            if t is not None:
                self.register_buffer(f"field{i}", t)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.lora_a = torch.nn.Parameter(lora_a.detach())
        self.lora_b = torch.nn.Parameter(lora_b.detach())
        self.separate_lora_x = separate_lora_x  # a deterministic stand-in for dropout on the LoRA branch

    def forward(self, x):
        tensors = [getattr(self, f"field{i}") if present else None for i, present in enumerate(self.present)]
        weight = weight_from_fields(tensors, self.meta, self.quant_type)
        lora_x = x * 0.5 if self.separate_lora_x else None
        return fastlora_linear(x, weight, self.bias, self.lora_a, self.lora_b, 2.0, lora_x)


def _module_and_input(kind="nf4-nested", x_dtype=torch.float32, separate_lora_x=False, device="cpu", n=40, k=100,
                      lead=(2, 3)):  # fmt: skip
    weight = make_weight(kind, n, k, device=device)
    x, bias, lora_a, lora_b, _ = make_inputs(lead, n, k, x_dtype, torch.float32, device=device)
    return _QLoraLinear(weight, bias, lora_a, lora_b, separate_lora_x).to(device), x.requires_grad_()


def _grads(module, x):
    return [x.grad] + [p.grad for p in (module.lora_a, module.lora_b)]


def _check_compiled_matches_eager(module, x, compiled):
    """Compiled forward and grads are bit-identical to eager: the same kernels and cuBLAS calls run on the same inputs
    (AOTAutograd only reorders independent ops; nothing is fused into the custom ops)."""
    y_eager = module(x)
    y_eager.float().square().sum().backward()
    eager_grads = _grads(module, x)
    x.grad = module.lora_a.grad = module.lora_b.grad = None
    y = compiled(x)
    y.float().square().sum().backward()
    assert y.dtype == x.dtype and torch.equal(y, y_eager)
    for name, got, want in zip(("dx", "dA", "dB"), _grads(module, x), eager_grads):
        assert got is not None and got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("kind", ["nf4-nested", "int8"])
def test_compile_fullgraph_reference_path(fresh_dynamo, reference_path, kind):
    module, x = _module_and_input(kind)
    _check_compiled_matches_eager(module, x, torch.compile(module, fullgraph=True, backend="eager"))


@pytest.mark.parametrize("kind,separate_lora_x", [("nf4-nested", False), ("nf4-nested", True), ("int8", True),
                                                  ("fp4-bf16storage", False)])  # fmt: skip
def test_compile_fullgraph_custom_op(fresh_dynamo, force_triton, kind, separate_lora_x):
    module, x = _module_and_input(kind, separate_lora_x=separate_lora_x, k=104)
    graphs = []
    compiled = torch.compile(module, fullgraph=True, backend=_recording_backend(graphs))
    _check_compiled_matches_eager(module, x, compiled)
    assert len(graphs) == 1 and "peft_fastlora.lora_linear" in graphs[0]
    with torch.no_grad():  # decode shape without grad: the fused small-M op
        y = compiled(x[0, :1])
        assert torch.equal(y, module(x[0, :1]))
    assert "peft_fastlora.lora_linear_small_m" in graphs[-1]


def test_decode_with_dynamic_shapes_takes_the_small_m_op(fresh_dynamo, force_triton):
    """With a symbolic row count (as a compiled decode step sees it), one row still runs the fused small-M op, and
    the row count guard sends a prefill-sized input to the dequant + matmul op."""
    module, x = _module_and_input()
    graphs = []
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=_recording_backend(graphs))
    with torch.no_grad():
        past = kernels.load().small_m.SMALL_M_MAX + 1  # no table off CUDA: the untabled limit
        for rows, op in ((1, "lora_linear_small_m"), (2, "lora_linear_small_m"), (past, "lora_linear.default")):
            x_rows = torch.randn(1, rows, x.shape[-1])
            assert torch.equal(compiled(x_rows), module(x_rows))
            assert f"peft_fastlora.{op}" in graphs[-1], (rows, graphs[-1])


def test_compile_fullgraph_under_autocast(fresh_dynamo, force_triton):
    module, x = _module_and_input()

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(x)

    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, step(x))


@pytest.mark.parametrize("kind", ["nf4-nested", "fp4-bf16storage", "int8"])
def test_opcheck_custom_ops(force_triton, kind):
    weight = make_weight(kind, 40, 104, device="cpu")
    fields = weight.to_fields()
    x, bias, lora_a, lora_b, _ = make_inputs((2, 3), 40, 104, torch.float32, device="cpu", requires_grad=True)
    bias.requires_grad_()
    lora_x = torch.randn_like(x).requires_grad_()
    cases = [
        (x, bias, lora_a, lora_b, 0.5, None, *fields),
        (x, None, lora_a, lora_b, 2.0, lora_x, *fields),
        (x, bias, None, None, 1.0, None, *fields),
    ]
    for args in cases if kind == "nf4-nested" else cases[:1]:  # the argument variants once; each weight kind once
        torch.library.opcheck(custom_ops.lora_linear_op, args)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(custom_ops.lora_linear_small_m_op, detached)
    torch.library.opcheck(custom_ops.dequantize_op, (torch.bfloat16, *fields))
    assert torch.equal(custom_ops.dequantize_op(torch.float16, *fields), dequantize_ref(weight, torch.float16))


def test_compile_fullgraph_reads_the_tuned_crossover(fresh_dynamo, force_triton, monkeypatch):
    """Under torch.compile the crossover lookup (which asks CUDA for the GPU's name, a str) is a trace-time constant;
    the table is still honoured: with a crossover of 2 rows, 2 rows take the fused op and 3 rows the autograd op."""
    small_m = kernels.load().small_m

    def device_table(device):
        torch._dynamo.graph_break()  # untraceable, like torch.cuda.get_device_name (returns a str) on the GPU
        return {"kinds": {"nf4": {"40x100": {"crossover_m": 2, "configs": {}}}}}

    monkeypatch.setattr(tuning, "device_table", device_table)
    small_m._tabled_small_m_limit.cache_clear()
    try:
        module, x = _module_and_input()
        graphs = []
        compiled = torch.compile(module, fullgraph=True, backend=_recording_backend(graphs))
        with torch.no_grad():
            for rows, op in ((2, "peft_fastlora.lora_linear_small_m"), (3, "peft_fastlora.lora_linear.default")):
                assert torch.equal(compiled(x[0, :rows]), module(x[0, :rows]))
                assert op in graphs[-1], (rows, graphs[-1])
    finally:
        small_m._tabled_small_m_limit.cache_clear()


# ---- GPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_gpu_compile_inductor_fullgraph(fresh_dynamo, x_dtype):
    """Inductor may fuse the elementwise ops around the custom ops (the LoRA input's scaling, the loss), so the
    comparison allows the bf16/fp16 rounding of one such op: 1e-2 of the output magnitude."""
    from .helpers import assert_close_scaled

    module, x = _module_and_input(x_dtype=x_dtype, separate_lora_x=True, device="cuda", n=1024, k=768, lead=(4, 64))
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    y_eager, y = module(x), compiled(x)
    assert_close_scaled(y, y_eager, 1e-2, 1e-2, "y")
    with torch.no_grad():
        x_decode = x[:, :1].detach()
        assert_close_scaled(compiled(x_decode), module(x_decode), 1e-2, 1e-2, "decode")


@pytest.mark.gpu
def test_gpu_opcheck_custom_ops():
    weight = make_weight("nf4-nested", 384, 256, device="cuda")
    fields = weight.to_fields()
    x, bias, lora_a, lora_b, _ = make_inputs((2, 40), 384, 256, torch.bfloat16, torch.float32, device="cuda",
                                             requires_grad=True)  # fmt: skip
    torch.library.opcheck(custom_ops.lora_linear_op, (x, bias, lora_a, lora_b, 0.5, (x * 0.5).detach(), *fields))
    detached = (x[:, :3].detach(), bias, lora_a.detach(), lora_b.detach(), 0.5, None, *fields)
    torch.library.opcheck(custom_ops.lora_linear_small_m_op, detached)
    torch.library.opcheck(custom_ops.dequantize_op, (torch.float16, *fields))
