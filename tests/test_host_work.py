"""Host work per FastLoRA layer call, counted rather than timed: kernel launches and torch dispatches.

When the batch is small (decoding, batch-1 training) the GPU waits on the host, so every extra op in a layer call
costs wall time on every layer of every step (docs/benchmarks.md, "Host time per layer call"). Timing is a benchmark's
job; these tests pin what can be counted deterministically on CPU: the Triton path runs with its launches replaced by
counters (``PEFT_FASTLORA_FORCE_TRITON=1``, no kernel executes), and a ``TorchDispatchMode`` counts every aten op.
Raise a budget here only on purpose, with the benchmark numbers that justify it.
"""

from __future__ import annotations

import collections

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import peft_fastlora
from peft_fastlora.ops import kernels
from tests.ops.conftest import force_triton  # noqa: F401  (the one force-Triton fixture)
from tests.utils import load_quantized

# aten ops that only make views or metadata: no kernel launch on a GPU.
NO_LAUNCH = {"aten.view", "aten.t", "aten.detach", "aten._unsafe_view", "aten.reshape", "aten.empty", "aten.expand",
             "aten.slice"}  # fmt: skip


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in NO_LAUNCH)


@pytest.fixture
def triton_launches(monkeypatch, request):
    """Counts Triton launches of the fused decode, dequant and low-rank update kernels instead of running them."""
    request.getfixturevalue("force_triton")
    calls = []
    loaded = kernels.load()
    for module in (loaded.small_m, loaded.dequant, loaded.lowrank):
        monkeypatch.setattr(module, "launch", lambda kernel, *a, **k: calls.append(kernel.__name__))
    return calls


def _fastlora(path):
    return get_peft_model(load_quantized(path), peft_fastlora.FastLoraConfig(r=8, target_modules="all-linear"))


def _layer(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


def _decode(layer, x) -> CountOps:
    layer.eval()
    with torch.no_grad(), CountOps() as count:
        layer(x)
    return count


def _train(layer, x) -> CountOps:
    layer.train()
    params = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    with CountOps() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        torch.autograd.grad(y, params, torch.ones_like(y))
    return count


def test_fastlora_layer_launch_budget(tiny_llama_path, triton_launches):
    layer = _layer(_fastlora(tiny_llama_path))
    hidden = layer.in_features
    _decode(layer, torch.randn(1, 1, hidden, dtype=torch.bfloat16))  # builds the weight container and launch plans
    triton_launches.clear()
    decode = _decode(layer, torch.randn(1, 1, hidden, dtype=torch.bfloat16))
    # Decode: the memset of the kernel's counters and the fused kernel (weight, bias, xa = x @ A.T and B @ xa).
    assert triton_launches == ["_fused_small_m_kernel"], triton_launches
    assert decode.launches() == 1 and decode.ops["aten.zeros"] == 1, dict(decode.ops)
    assert sum(decode.ops.values()) <= 6, dict(decode.ops)

    triton_launches.clear()
    x = torch.randn(1, 16, hidden, dtype=torch.bfloat16, requires_grad=True)
    _train(layer, x)  # warm the plans for the backward dtype too
    triton_launches.clear()
    train = _train(layer, x)
    # Forward: dequant, x @ W.T, x @ A.T, += xa @ B.T (Triton). Backward: g @ B and dB (scaling in cuBLAS alpha), dA,
    # dequant, g @ W, += t @ A (Triton). Plus the ones_like of this test's grad_outputs.
    assert triton_launches == ["_dequant_4bit_kernel", "_lowrank_add_kernel", "_dequant_4bit_kernel",
                               "_lowrank_add_kernel"], triton_launches  # fmt: skip
    assert train.launches() == 7 and sum(train.ops.values()) <= 22, dict(train.ops)


def test_fastlora_needs_fewer_launches_than_peft_lora_on_bf16(tiny_llama_path, triton_launches):
    """The same layer call under PEFT's LoRA (its defaults) on an unquantized bf16 layer launches more kernels."""
    fast = _fastlora(tiny_llama_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    x1 = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    xg = torch.randn(1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    _decode(_layer(fast), x1)  # warm: the first call builds the cached weight container
    triton_launches.clear()
    fast_decode = _decode(_layer(fast), x1).launches() + len(triton_launches)  # + the stubbed Triton launches
    triton_launches.clear()
    fast_train = _train(_layer(fast), xg).launches() + len(triton_launches)
    assert triton_launches, "the Triton launches must be counted, not skipped"
    peft_decode, peft_train = _decode(_layer(peft), x1).launches(), _train(_layer(peft), xg).launches()
    assert fast_decode < peft_decode and fast_train < peft_train, (fast_decode, peft_decode, fast_train, peft_train)


def _qkv_train(model, x) -> tuple[CountOps, list[str]]:
    attn = model.base_model.model.model.layers[0].self_attn
    layers = (attn.q_proj, attn.k_proj, attn.v_proj)
    params = [x] + [t for layer in layers for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]
    model.train()
    with CountOps() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = [layer(x) for layer in layers]
        torch.autograd.grad(ys, params, [torch.ones_like(y) for y in ys])
    return count


def test_a_projection_group_launches_less_than_its_layers(tiny_llama_path, triton_launches):
    """q, k and v of one attention as the fast path's one op (``group_projections=True``) against the three layers'
    own ops: one ``xa`` and one ``dA`` matmul instead of three each, ``dx`` accumulated in the matmuls instead of two
    autograd adds, one low-rank pass into ``dx`` instead of three."""
    grouped, separate = _fastlora(tiny_llama_path), _fastlora(tiny_llama_path)
    peft_fastlora.enable_fast_path(grouped, liger=False, fused_loss=False, fuse_mlp=False)
    peft_fastlora.enable_fast_path(separate, liger=False, fused_loss=False, fuse_mlp=False, group_projections=False)
    x = torch.randn(1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    counts = {}
    for name, model in (("grouped", grouped), ("separate", separate)):
        _qkv_train(model, x)  # warm
        triton_launches.clear()
        ops = _qkv_train(model, x)
        counts[name] = (ops.launches(), sorted(triton_launches), ops.ops["aten.add"] + ops.ops["aten.add_"])
    (grouped_aten, grouped_triton, grouped_adds), (separate_aten, separate_triton, separate_adds) = counts.values()
    # Triton: three dequants each way; three forward adds; backward: one low-rank pass instead of three.
    assert grouped_triton == sorted(["_dequant_4bit_kernel"] * 6 + ["_lowrank_add_kernel"] * 4), grouped_triton
    assert separate_triton == sorted(["_dequant_4bit_kernel"] * 6 + ["_lowrank_add_kernel"] * 6), separate_triton
    assert separate_adds - grouped_adds == 2  # autograd's sums of the three dx
    # aten, each counting the test's three ones_like: separate 3 x 6 + 2 sums; grouped: forward cat(A), xa, three
    # base matmuls; backward three t and three dB (addmm), one dA, dx in three matmuls, cat(A) for the low-rank pass
    assert (grouped_aten, separate_aten) == (19, 23), counts
