"""``LoraLinearFunction`` (dequantize + cuBLAS training path) against an fp32 ``lora_linear_ref`` with torch autograd.

On CPU the Function runs with the interpreted Triton dequant (``PEFT_FASTLORA_FORCE_TRITON=1``) on small shapes; the
``gpu`` tests use Llama-3-8B shapes.
"""

from __future__ import annotations

import os

import bitsandbytes.functional as bnbF
import pytest
import torch
from peft_fastlora.bnb_weights import packed4bit_from_bnb

from peft_fastlora.ops import LoraLinearFunction, fastlora_linear
from peft_fastlora.ops import lora_linear as lora_linear_module
from peft_fastlora.ops.quant_state import Int8Rowwise
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

# (x dtype, adapter dtype, atol, rtol); atol is relative to the largest reference value (see `assert_close_scaled`).
DTYPE_CASES = [
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.float16, torch.float16, 5e-3, 5e-3, id="fp16"),
    pytest.param(torch.float16, torch.float32, 5e-3, 5e-3, id="fp16-fp32adapters"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 3e-2, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 3e-2, id="bf16-fp32adapters"),
]
# 4-bit (quant_type, nested, quant_storage) or int8.
WEIGHT_KINDS = ["nf4", "nf4-nested", "fp4-nested-bf16storage", "int8"]
# (leading dims of x, out_features N, in_features K): M=1, 3-D input, K not a multiple of the block, odd N.
SHAPES = [((1,), 40, 100), ((2, 3), 72, 96), ((17,), 48, 130)]


def skip_unless_interpreted() -> None:
    """Triton on CPU tensors needs the interpreter, which conftest turns on only when CUDA is absent."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest only without CUDA)")


@pytest.fixture
def force_triton(monkeypatch):
    skip_unless_interpreted()
    monkeypatch.setenv("PEFT_FASTLORA_FORCE_TRITON", "1")


def make_weight(kind: str, n: int, k: int, device="cpu", blocksize: int = 64):
    """A quantized random ``(n, k)`` weight whose dequantized entries are ~1/sqrt(k), so outputs are O(1)."""
    w = (torch.randn(n, k) / k**0.5).to(device)
    if kind == "int8":
        cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
        return Int8Rowwise(cb=cb, scb=scb)
    storage = torch.bfloat16 if kind.endswith("bf16storage") else torch.uint8
    q, state = bnbF.quantize_4bit(
        w, blocksize=blocksize, quant_type=kind[:3], compress_statistics="nested" in kind, quant_storage=storage
    )
    return packed4bit_from_bnb(q, state)


def make_inputs(lead, n, k, x_dtype, adapter_dtype, r=8, device="cpu", bias=True):
    x = torch.randn(*lead, k, device=device, dtype=x_dtype, requires_grad=True)
    lora_a = (torch.randn(r, k, device=device) / k**0.5).to(adapter_dtype).requires_grad_()
    lora_b = (torch.randn(n, r, device=device) / r**0.5).to(adapter_dtype).requires_grad_()
    b = torch.randn(n, device=device, dtype=x_dtype) if bias else None
    return x, b, lora_a, lora_b


def fp32_leaf(t):
    return None if t is None else t.detach().float().requires_grad_(t.requires_grad)


def assert_close_scaled(actual, expected, atol, rtol, name=""):
    """``assert_close`` in fp32 with ``atol`` scaled by the reference's magnitude (values here are O(1)..O(sqrt(M)))."""
    scale = max(1.0, expected.detach().abs().max().item())
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}"
    )


def run_and_compare(x, weight, bias, lora_a, lora_b, scaling, lora_x, atol, rtol, fn=LoraLinearFunction.apply):
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
    x, bias, lora_a, lora_b = make_inputs(lead, n, k, x_dtype, adapter_dtype)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, atol, rtol)


@pytest.mark.parametrize("x_dtype, adapter_dtype, atol, rtol", DTYPE_CASES)
def test_separate_lora_input(force_triton, x_dtype, adapter_dtype, atol, rtol):
    """Dropout on the LoRA branch: grads reach x through both branches, and an independent lora_x gets its own."""
    weight = make_weight("nf4-nested", 56, 96)
    x, bias, lora_a, lora_b = make_inputs((3, 5), 56, 96, x_dtype, adapter_dtype)
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
    x, bias, lora_a, lora_b = make_inputs((2, 7), 40, 100, x_dtype, adapter_dtype)
    fp32_bias = bias.detach().float().requires_grad_()  # fp32 bias with 16-bit x: its grad comes back in fp32
    run_and_compare(x, weight, fp32_bias, lora_a, lora_b, 2.0, None, atol, rtol)
    x.grad = None
    run_and_compare(x, weight, bias.detach().clone().requires_grad_(), None, None, 1.0, None, atol, rtol)
    x.grad = None
    run_and_compare(x, weight, None, None, None, 1.0, None, atol, rtol)


def test_skips_unneeded_grads(force_triton, monkeypatch):
    """A frozen input (first layer) never re-dequantizes W; frozen adapters get no grad and no work."""
    calls = []
    real = lora_linear_module.dequantize_kernel

    def counting(weight, dtype):
        calls.append(dtype)
        return real(weight, dtype)

    monkeypatch.setattr(lora_linear_module, "dequantize_kernel", counting)
    weight = make_weight("nf4", 40, 100)
    x, bias, lora_a, lora_b = make_inputs((6,), 40, 100, torch.float32, torch.float32)
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
    x, bias, lora_a, lora_b = make_inputs((4,), n, k, torch.bfloat16, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    fn = fastlora_linear if via_dispatch else LoraLinearFunction.apply
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, weight, bias, lora_a, lora_b, 2.0, None)
    assert saved, "the LoRA branch input and xa must be saved"
    assert all(t.numel() < n * k for t in saved), [tuple(t.shape) for t in saved]
    y.sum().backward()


def test_bad_arguments_raise_clear_errors(force_triton):
    weight = make_weight("nf4", 40, 100)
    x, bias, lora_a, lora_b = make_inputs((3,), 40, 100, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="in_features=100"):
        LoraLinearFunction.apply(x[:, :99], weight, bias, lora_a, lora_b, 1.0, None)
    with pytest.raises(ValueError, match="`lora_a` and `lora_b` must be given together"):
        LoraLinearFunction.apply(x, weight, bias, lora_a, None, 1.0, None)
    with pytest.raises(ValueError, match="`lora_b`"):
        LoraLinearFunction.apply(x, weight, bias, lora_a, lora_b[:-1], 1.0, None)
    with pytest.raises(TypeError, match="Packed4bit or Int8Rowwise"):
        LoraLinearFunction.apply(x, dequantize_ref(weight, torch.float32), bias, lora_a, lora_b, 1.0, None)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        LoraLinearFunction.apply(x.double(), weight, bias, lora_a, lora_b, 1.0, None)


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
    x, bias, lora_a, lora_b = make_inputs((2, 1024), n, k, x_dtype, adapter_dtype, r=16, device="cuda", bias=False)
    run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, atol, rtol, fn=fastlora_linear)


@pytest.mark.gpu
def test_gpu_bf16_then_fp16_has_no_stale_state():
    """The same weights used in bf16, then fp16, then bf16 again (large and small M) give right results each time."""
    weight = make_weight("nf4-nested", 1024, 768, device="cuda")
    for x_dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        tol = 2e-2 if x_dtype == torch.bfloat16 else 4e-3
        for m in (1, 300):
            x, bias, lora_a, lora_b = make_inputs((m,), 1024, 768, x_dtype, torch.float32, device="cuda")
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
        x, bias, lora_a, lora_b = make_inputs((m,), 512, 384, torch.bfloat16, torch.float32, device="cuda:1")
        with torch.cuda.device(0):  # the current device is not the tensors' device
            y = run_and_compare(x, weight, bias, lora_a, lora_b, 2.0, None, 2e-2, 2e-2, fn=fastlora_linear)
        assert y.device == torch.device("cuda:1") and x.grad.device == y.device


@pytest.mark.gpu
def test_gpu_forward_memory_grows_less_than_one_weight_per_layer():
    n = k = 4096
    m, n_layers = 256, 4
    layers = [make_weight("nf4-nested", n, k, device="cuda") for _ in range(n_layers)]
    adapters = [make_inputs((1,), n, k, torch.bfloat16, torch.float32, r=16, device="cuda")[2:] for _ in layers]
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
