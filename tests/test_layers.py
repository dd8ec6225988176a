"""FastLoRA layers over bitsandbytes layers: dispatch, forward math and dtypes, gradients, adapters API."""

import warnings

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from torch import nn

import peft_fastlora
from peft_fastlora.bnb import FastLoraLinear4bit, FastLoraLinear8bit
from peft_fastlora.ops.reference import dequantize_ref
from tests.ops.conftest import force_triton  # noqa: F401  (the one force-Triton fixture)
from tests.utils import fast_config as shared_fast_config
from tests.utils import load_quantized, logits, tokens

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (activation dtype, atol, rtol) against an fp32 computation on the same dequantized weights: fp32 is exact up to
# summation order; fp16/bf16 round the inputs, the weight and the output (bf16 has an 8-bit mantissa).
ACT_TOLS = [(FP32, 1e-5, 1e-5), (FP16, 2e-3, 2e-3), (BF16, 2e-2, 2e-2)]


def fast_config(**kwargs):
    return shared_fast_config(**{"init_lora_weights": False, "task_type": None, **kwargs})


@pytest.fixture(params=["nf4", "fp4", "nf4-dq", "int8"])
def quant(request):
    return request.param


def quantized(path, quant, compute=BF16, dtype=BF16):
    if quant == "int8":
        return load_quantized(path, dtype=dtype, bits=8)
    return load_quantized(path, dtype=dtype, bits=4, quant_type=quant[:3], compute_dtype=compute,
                          double_quant=quant.endswith("-dq"))


def first_layer(model):
    return model.base_model.model.model.layers[0].mlp.down_proj


def test_quantized_targets_become_fastlora_layers(tiny_llama_path, quant):
    model = get_peft_model(quantized(tiny_llama_path, quant), fast_config())
    expected = FastLoraLinear8bit if quant == "int8" else FastLoraLinear4bit
    layers = [m for m in model.modules() if isinstance(m, peft_fastlora.FastLoraLayer)]
    assert len(layers) == 2 * 7  # 2 decoder layers x (q, k, v, o, gate, up, down)
    assert all(type(m) is expected for m in layers)


def test_unquantized_targets_keep_peft_layers(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "nf4"), fast_config(target_modules=["down_proj", "lm_head"]))
    assert isinstance(model.base_model.model.lm_head, PeftLoraLinear)
    assert not isinstance(model.base_model.model.lm_head, peft_fastlora.FastLoraLayer)
    assert isinstance(first_layer(model), FastLoraLinear4bit)


def expected_output(layer, x):
    """fp32 computation of base + LoRA on the layer's own dequantized weight."""
    w = dequantize_ref(layer.quantized_weight(), FP32)
    bias = layer.get_base_layer().bias
    out = x.float() @ w.T + (0 if bias is None else bias.float())
    a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
    return out + (x.float() @ a.T @ b.T) * layer.scaling["default"]


@pytest.mark.parametrize("act_dtype, atol, rtol", ACT_TOLS)
@pytest.mark.parametrize("compute", [BF16, FP16, FP32])
def test_output_dtype_is_activation_dtype_whatever_the_compute_dtype(tiny_llama_path, quant, compute, act_dtype,
                                                                     atol, rtol):
    # fp32 adapters isolate the base path: with bf16 adapters the LoRA term is computed in bf16 by design.
    model = get_peft_model(quantized(tiny_llama_path, quant, compute=compute), fast_config(adapter_dtype="fp32"))
    layer = first_layer(model)
    x = torch.randn(2, 5, layer.in_features, dtype=act_dtype)
    out = layer(x)
    assert out.dtype == act_dtype
    assert out.shape == (2, 5, layer.out_features)
    torch.testing.assert_close(out.float(), expected_output(layer, x), atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("act_dtype, atol, rtol", ACT_TOLS)
def test_gradients_for_x_and_adapters_none_for_base(tiny_llama_path, quant, act_dtype, atol, rtol):
    model = get_peft_model(quantized(tiny_llama_path, quant), fast_config(adapter_dtype="fp32"))
    layer = first_layer(model)
    x = torch.randn(3, layer.in_features, dtype=act_dtype, requires_grad=True)
    grad_out = torch.randn(3, layer.out_features, dtype=act_dtype)
    layer(x).backward(grad_out)

    a = layer.lora_A["default"].weight.detach().clone().requires_grad_()
    b = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    w = dequantize_ref(layer.quantized_weight(), FP32)
    ref = x32 @ w.T + (x32 @ a.T @ b.T) * layer.scaling["default"]
    ref.backward(grad_out.float())

    assert x.grad.dtype == act_dtype and layer.lora_A["default"].weight.grad.dtype == FP32
    scale = 10 if act_dtype != FP32 else 1
    torch.testing.assert_close(x.grad.float(), x32.grad, atol=atol * scale, rtol=rtol * scale)
    torch.testing.assert_close(layer.lora_A["default"].weight.grad, a.grad, atol=atol * scale, rtol=rtol * scale)
    torch.testing.assert_close(layer.lora_B["default"].weight.grad, b.grad, atol=atol * scale, rtol=rtol * scale)
    assert not layer.get_base_layer().weight.requires_grad


def test_disable_adapter_gives_the_base_output(tiny_llama_path, quant):
    model = get_peft_model(quantized(tiny_llama_path, quant), fast_config())
    layer = first_layer(model)
    x = torch.randn(4, layer.in_features, dtype=BF16)
    base_only = x @ dequantize_ref(layer.quantized_weight(), BF16).T
    with model.disable_adapter():
        torch.testing.assert_close(layer(x), base_only)
    assert not torch.allclose(layer(x), base_only)


def test_several_adapters_set_adapter_and_mixed_batch(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "nf4"), fast_config())
    model.add_adapter("other", fast_config(r=4))
    ids = torch.randint(0, 128, (3, 6))
    model.eval()
    with torch.no_grad():
        logits_default = model(ids).logits
        model.set_adapter("other")
        logits_other = model(ids).logits
        with model.disable_adapter():
            logits_base = model(ids).logits
        mixed = model(ids, adapter_names=["default", "other", "__base__"]).logits
    assert not torch.allclose(logits_default, logits_other)
    torch.testing.assert_close(mixed[0], logits_default[0])
    torch.testing.assert_close(mixed[1], logits_other[1])
    torch.testing.assert_close(mixed[2], logits_base[2])


def test_two_active_adapters_add_up(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "nf4", dtype=FP32, compute=FP32), fast_config())
    model.add_adapter("other", fast_config(r=4))
    layer = first_layer(model)
    x = torch.randn(2, layer.in_features)
    base = x @ dequantize_ref(layer.quantized_weight(), FP32).T
    deltas = {}
    for name in ("default", "other"):
        layer.set_adapter(name)
        deltas[name] = layer(x) - base
    layer.set_adapter(["default", "other"])
    torch.testing.assert_close(layer(x), base + deltas["default"] + deltas["other"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy, compute, expected", [("fp32-if-fp16", FP16, FP32), ("fp32-if-fp16", BF16, BF16),
                                                      ("bf16", FP16, BF16), ("fp32", BF16, FP32)])
@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_policy_holds_over_peft_autocast(tiny_llama_path, policy, compute, expected, autocast_adapter_dtype):
    base = quantized(tiny_llama_path, "nf4", compute=compute, dtype=compute)
    model = get_peft_model(base, fast_config(adapter_dtype=policy), autocast_adapter_dtype=autocast_adapter_dtype)
    model.add_adapter("second", fast_config(adapter_dtype=policy))
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {expected}


def test_8bit_policy_uses_model_dtype(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "int8", dtype=FP16), fast_config())
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {FP32}


def test_outside_cast_is_restored_with_a_warning(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "nf4", compute=FP16, dtype=FP16), fast_config())
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params)
    for p in params:  # what TRL does to trainable params of quantized models
        p.data = p.data.to(BF16)
    ids = torch.randint(0, 128, (2, 5))
    with pytest.warns(UserWarning, match="restoring the `adapter_dtype` policy's torch.float32"):
        model(ids, labels=ids).loss.backward()
    assert {p.dtype for p in params} == {FP32}
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in params)
    assert optimizer.param_groups[0]["params"][0] is params[0]


def test_4bit_weight_repacked_by_bnb_cpu_inference_is_restored(tiny_llama_path):
    base = quantized(tiny_llama_path, "nf4", compute=FP32, dtype=FP32)
    layer = base.model.layers[0].self_attn.q_proj  # in 64 x out 64: bnb's CPU repacking applies
    reference = dequantize_ref(peft_fastlora.bnb.packed4bit_from_bnb(layer.weight.data, layer.weight.quant_state),
                               FP32)
    if not layer.support_avx512bf16_for_cpu:
        pytest.skip("bitsandbytes only repacks on CPUs with AVX512-BF16")
    base.eval()
    with torch.no_grad():
        layer(torch.randn(1, 64))
    assert layer.weight.quant_state.packing_format_for_cpu
    model = get_peft_model(base, fast_config())
    fast = model.base_model.model.model.layers[0].self_attn.q_proj
    with pytest.warns(UserWarning, match="repacked by bitsandbytes' CPU inference path"):
        restored = dequantize_ref(fast.quantized_weight(), FP32)
    torch.testing.assert_close(restored, reference, atol=1e-2, rtol=1e-2)  # absmax went through bf16


def test_module_level_8bit_with_fp16_weights_keeps_peft_layer():
    model = nn.Sequential()
    model.add_module("proj", bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=True))
    peft_model = get_peft_model(model, fast_config(target_modules=["proj"]))
    assert not isinstance(peft_model.base_model.model.proj, peft_fastlora.FastLoraLayer)


def test_stock_lora_config_still_uses_peft_layers(tiny_llama_path):
    model = get_peft_model(quantized(tiny_llama_path, "nf4"), LoraConfig(r=4, target_modules=["down_proj"]))
    assert not any(isinstance(m, peft_fastlora.FastLoraLayer) for m in model.modules())


def test_weight_container_is_reused_and_dropped_on_move(tiny_llama_path):
    from peft_fastlora.layer import WEIGHT_CACHE

    layer = first_layer(get_peft_model(quantized(tiny_llama_path, "nf4"), fast_config()))
    first = layer.quantized_weight()
    assert layer.quantized_weight() is first  # validated launch arguments live on the container
    layer.to("cpu")
    assert WEIGHT_CACHE not in layer.__dict__
    assert layer.quantized_weight() is not first
    second = layer.quantized_weight()
    layer.invalidate_weight_cache()
    assert layer.quantized_weight() is not second


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_8bit_scales_are_read_from_the_layer_state_after_a_bnb_forward(tiny_llama_path, device):
    """bitsandbytes moves the row scales from `weight.SCB` to `layer.state.SCB` at a Linear8bitLt's first forward."""
    base = load_quantized(tiny_llama_path, dtype=FP16, bits=8, device=device)
    with torch.no_grad():
        base(input_ids=tokens().to(device))  # e.g. a baseline generate before wrapping
    bnb_layer = base.model.layers[0].mlp.down_proj
    assert getattr(bnb_layer.weight, "SCB", None) is None and bnb_layer.state.SCB is not None
    expected = (bnb_layer.weight.data.float() * bnb_layer.state.SCB.float()[:, None] / 127).cpu()
    model = get_peft_model(base, fast_config())
    layer = first_layer(model)
    torch.testing.assert_close(dequantize_ref(layer.quantized_weight(), FP32).cpu(), expected, atol=1e-6, rtol=1e-6)
    out = logits(model)
    assert out.isfinite().all()


def test_fp32_activations_into_16bit_compute_warn_once_with_the_fix(tiny_llama_path):
    """prepare_model_for_kbit_training upcasts norms and embeddings: 4-bit layers then get fp32 activations."""
    from peft import prepare_model_for_kbit_training

    base = prepare_model_for_kbit_training(quantized(tiny_llama_path, "nf4", compute=BF16, dtype=BF16),
                                           use_gradient_checkpointing=False)
    model = get_peft_model(base, fast_config())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's usual filter: one report per warning location
        logits(model)
        logits(model)
    found = [str(w.message) for w in record if "receives float32 activations" in str(w.message)]
    assert len(found) == 1 and "torch.autocast" in found[0] and "bf16=True" in found[0], found
    assert all(m._activations_checked for m in model.modules() if isinstance(m, peft_fastlora.FastLoraLayer))


def test_fp32_activations_under_autocast_do_not_warn(tiny_llama_path):
    from peft import prepare_model_for_kbit_training

    base = prepare_model_for_kbit_training(quantized(tiny_llama_path, "nf4", compute=BF16, dtype=BF16),
                                           use_gradient_checkpointing=False)
    model = get_peft_model(base, fast_config())
    with warnings.catch_warnings(record=True) as record, torch.autocast("cpu", dtype=BF16):
        warnings.simplefilter("always")
        logits(model)
    assert not [w for w in record if "receives float32 activations" in str(w.message)]


# ---- decode lanes: the prepared small-M call of no-grad layer calls (layer.py, DECODE_LANES) ------------------------
def _lane_model(path, quant="nf4", **config):
    model = get_peft_model(quantized(path, quant), fast_config(**config))
    model.add_adapter("other", fast_config(r=4, lora_alpha=4))
    return model.eval()


def _spy_on_prepare(monkeypatch, request, name: str) -> list:
    """The Triton path on CPU (interpreter), and the input shape of every call ``ops.<name>`` prepares."""
    from peft_fastlora import ops

    request.getfixturevalue("force_triton")
    calls = []
    real = getattr(ops, name)

    def prepare(x, *args):
        run = real(x, *args)
        if run is not None:
            calls.append(tuple(x.shape))
        return run

    monkeypatch.setattr(ops, name, prepare)
    return calls


@pytest.fixture
def prepares(monkeypatch, request):
    """The input shape of every decode call the layers prepare (Triton interpreted)."""
    return _spy_on_prepare(monkeypatch, request, "prepare_small_m_call")


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "int8"])
def test_decode_lane_is_prepared_once_and_matches_the_op(tiny_llama_path, quant, prepares):
    from peft_fastlora import ops
    from peft_fastlora.ops.reference import lora_linear_ref

    layer = first_layer(_lane_model(tiny_llama_path, quant))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x_dtype = FP16 if quant == "int8" else BF16
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(2, 1, layer.in_features, dtype=x_dtype, generator=torch.Generator().manual_seed(seed))
            y = layer(x)
            op = ops.fastlora_linear(x, layer.quantized_weight(), None, a, b, layer.scaling["default"])
            assert torch.equal(y, op)  # the same kernel and arguments: bit-identical
            ref = lora_linear_ref(x.float(), layer.quantized_weight(), None, a.float(), b.float(),
                                  layer.scaling["default"])  # fmt: skip
            torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    assert prepares == [(2, 1, layer.in_features)]  # built by the first call, reused by the next two


def _change(model, layer, change):
    b = layer.lora_B["default"].weight
    if change == "lora_b_in_place":  # an optimizer step: the lane reads the new values
        b.add_(torch.randn_like(b))
    elif change == "lora_b_replaced":  # new storage: the lane's pointer is stale
        b.data = b.data + torch.randn_like(b)
    elif change == "scaling":
        layer.scaling["default"] = 3.0
    elif change == "other_adapter":
        model.set_adapter("other")
    elif change == "adapters_disabled":
        layer.enable_adapters(False)
    elif change == "merged":
        with pytest.warns(UserWarning, match="requantizes"):
            layer.merge()
    elif change == "base_weight_replaced":
        layer.store_weight(layer.dequantized_weight(FP32) * 1.5)
    else:
        raise AssertionError(change)


@pytest.mark.parametrize("change", ["lora_b_in_place", "lora_b_replaced", "scaling", "other_adapter",
                                    "adapters_disabled", "merged", "base_weight_replaced"])  # fmt: skip
def test_decode_lane_follows_every_layer_change(tiny_llama_path, change, prepares):
    """After each change, the layer's output equals that of a lane built afresh (and differs from before)."""
    from peft_fastlora.layer import DECODE_LANES

    model = _lane_model(tiny_llama_path)
    layer = first_layer(model)
    x = torch.randn(1, 1, layer.in_features, dtype=BF16)
    with torch.no_grad():
        before = layer(x)
        assert torch.equal(layer(x), before) and len(prepares) == 1
        _change(model, layer, change)
        after = layer(x)
        layer.__dict__.pop(DECODE_LANES)
        fresh = layer(x)
    assert torch.equal(after, fresh)
    assert not torch.equal(after, before)
    rebuilt = change not in ("lora_b_in_place", "scaling")  # those two keep the lane: values are read per call
    assert len(prepares) == (3 if rebuilt else 2)  # first call, [after the change,] after the pop


@pytest.mark.parametrize("case", ["grad", "dropout_training", "autocast_other_dtype", "adapter_names", "two_adapters"])
def test_decode_lane_is_not_used_where_the_general_path_differs(tiny_llama_path, case, prepares):
    from peft_fastlora.layer import DECODE_LANES

    model = _lane_model(tiny_llama_path, lora_dropout=0.5 if case == "dropout_training" else 0.0)
    layer = first_layer(model)
    x = torch.randn(2, 1, layer.in_features, dtype=BF16)
    with torch.no_grad():
        layer(x)  # a lane for this shape
    assert len(prepares) == 1
    if case == "dropout_training":
        layer.train()
    if case == "two_adapters":
        layer.set_adapter(["default", "other"])
    with torch.set_grad_enabled(case == "grad"), torch.autocast("cpu", dtype=FP16,
                                                                 enabled=case == "autocast_other_dtype"):  # fmt: skip
        kwargs = {"adapter_names": ["default", "other"]} if case == "adapter_names" else {}
        y = layer(x, **kwargs)
    assert len(prepares) == 1, "no lane may be built or used here"
    assert len(layer.__dict__[DECODE_LANES]) == 1
    assert y.dtype == (FP16 if case == "autocast_other_dtype" else BF16) and y.isfinite().all()


def test_decode_lanes_per_shape_and_dropped_on_move(tiny_llama_path, prepares):
    from peft_fastlora.layer import DECODE_LANES, MAX_LANES

    layer = first_layer(_lane_model(tiny_llama_path))
    with torch.no_grad():
        for rows in (1, 2, 1, 2):
            layer(torch.randn(rows, 1, layer.in_features, dtype=BF16))
        assert prepares == [(1, 1, layer.in_features), (2, 1, layer.in_features)]
        for rows in range(3, 3 + MAX_LANES):
            layer(torch.randn(rows, layer.in_features, dtype=BF16))
    assert len(layer.__dict__[DECODE_LANES]) <= MAX_LANES
    with torch.no_grad():
        layer(torch.randn(1, 1, layer.in_features, dtype=BF16))
        layer(torch.randn(2, 1, layer.in_features, dtype=BF16))
        layer.store_weight(layer.dequantized_weight(FP32))  # new base weight: the other lane would pin the old one
        layer(torch.randn(1, 1, layer.in_features, dtype=BF16))
    assert list(layer.__dict__[DECODE_LANES]) == [(torch.Size([1, 1, layer.in_features]), BF16, torch.device("cpu"))]
    layer.to("cpu")
    assert DECODE_LANES not in layer.__dict__


# ---- training lanes: the prepared autograd op of grad-mode layer calls (layer.py, TRAIN_LANES) ---------------------
@pytest.fixture
def prepares_training(monkeypatch, request):
    """The input shape of every training call the layers prepare (Triton interpreted)."""
    return _spy_on_prepare(monkeypatch, request, "prepare_training_call")


def _train_call(layer, x, dy, autocast=None):
    """The layer's output and the grads of x, A and B for the output gradient ``dy``."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.autocast("cpu", dtype=autocast or BF16, enabled=autocast is not None):
        y = layer(x)
    return (y.detach(), *torch.autograd.grad(y, [x, a, b], dy))


def _general_path(layer, monkeypatch):
    """The layer with its training lanes dropped and none built again: every call takes the general path."""
    from peft_fastlora import ops
    from peft_fastlora.layer import TRAIN_LANES

    layer.__dict__.pop(TRAIN_LANES, None)
    monkeypatch.setattr(ops, "prepare_training_call", lambda *args: None)


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "int8"])
@pytest.mark.parametrize("autocast", [None, BF16], ids=["no-autocast", "autocast-same-dtype"])
def test_training_lane_is_prepared_once_and_trains_like_the_general_path(tiny_llama_path, quant, autocast,
                                                                         prepares_training, monkeypatch):  # fmt: skip
    model = get_peft_model(quantized(tiny_llama_path, quant), fast_config()).train()
    layer = first_layer(model)
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.05)  # B = 0 would make dA zero
    gen = torch.Generator().manual_seed(3)
    calls = [(torch.randn(2, 3, layer.in_features, dtype=BF16, generator=gen).requires_grad_(),
              torch.randn(2, 3, layer.out_features, dtype=BF16, generator=gen)) for _ in range(3)]  # fmt: skip
    laned = [_train_call(layer, x, dy, autocast) for x, dy in calls]
    assert prepares_training == [(2, 3, layer.in_features)]  # built by the first call, reused by the next two
    _general_path(layer, monkeypatch)
    general = [_train_call(layer, x, dy, autocast) for x, dy in calls]
    for got, expected in zip(laned, general):
        for name, g, e in zip(("y", "dx", "dA", "dB"), got, expected):
            assert torch.equal(g, e), name  # the same op and arguments: bit-identical
            assert g.isfinite().all() and g.abs().sum() > 0, name


@pytest.mark.parametrize("change", ["lora_b_in_place", "lora_b_replaced", "scaling", "other_adapter",
                                    "adapters_disabled", "merged", "base_weight_replaced",
                                    "adapter_frozen"])  # fmt: skip
def test_training_lane_follows_every_layer_change(tiny_llama_path, change, prepares_training, monkeypatch):
    """After each change, the layer trains as the general path does (and its output differs from before)."""
    model = _lane_model(tiny_llama_path).train()
    layer = first_layer(model)
    x = torch.randn(1, 4, layer.in_features, dtype=BF16, requires_grad=True)
    dy = torch.randn(1, 4, layer.out_features, dtype=BF16)
    before = layer(x).detach()
    assert torch.equal(layer(x).detach(), before) and len(prepares_training) == 1
    with torch.no_grad():  # as an optimizer step changes the adapters
        if change == "adapter_frozen":
            layer.lora_A["default"].weight.requires_grad_(False)
            layer.lora_B["default"].weight.requires_grad_(False)
            layer.lora_B["default"].weight.add_(1.0)
        else:
            _change(model, layer, change)
    after = layer(x)
    grads = [g for g in torch.autograd.grad(after, [x], dy)]
    _general_path(layer, monkeypatch)
    fresh = layer(x)
    assert torch.equal(after.detach(), fresh.detach())
    assert all(torch.equal(g, e) for g, e in zip(grads, torch.autograd.grad(fresh, [x], dy)))
    assert not torch.equal(after.detach(), before)
    # values read per call keep the lane; a frozen adapter (small-M may then serve the call) or no adapter take none
    kept = ("lora_b_in_place", "scaling", "adapters_disabled", "merged", "adapter_frozen")
    assert len(prepares_training) == (1 if change in kept else 2)


@pytest.mark.parametrize("case", ["no_grad", "dropout_training", "autocast_other_dtype", "adapter_names",
                                  "two_adapters"])
def test_training_lane_is_not_used_where_the_general_path_differs(tiny_llama_path, case, prepares_training):
    from peft_fastlora.layer import TRAIN_LANES

    # dropout in eval mode is an identity, so the lane is built then; in training mode it is not (PEFT refuses
    # adapter_names in training mode: that case stays in eval mode, grad on)
    model = _lane_model(tiny_llama_path, lora_dropout=0.5 if case == "dropout_training" else 0.0)
    model.train(case not in ("dropout_training", "adapter_names"))
    layer = first_layer(model)
    x = torch.randn(2, 3, layer.in_features, dtype=BF16, requires_grad=True)
    layer(x)  # a lane for this shape
    assert len(prepares_training) == 1
    if case == "dropout_training":
        layer.train()
    if case == "two_adapters":
        layer.set_adapter(["default", "other"])
    with torch.set_grad_enabled(case != "no_grad"), torch.autocast("cpu", dtype=FP16,
                                                                   enabled=case == "autocast_other_dtype"):  # fmt: skip
        kwargs = {"adapter_names": ["default", "other"]} if case == "adapter_names" else {}
        y = layer(x.detach() if case == "adapter_names" else x, **kwargs)
    assert len(prepares_training) == 1, "no training lane may be built or used here"
    assert len(layer.__dict__[TRAIN_LANES]) == 1
    assert y.dtype == (FP16 if case == "autocast_other_dtype" else BF16) and y.isfinite().all()


def test_training_lanes_are_left_behind_by_pickle_and_a_move(tiny_llama_path, prepares_training):
    import pickle

    from peft_fastlora.layer import TRAIN_LANES

    model = _lane_model(tiny_llama_path).train()
    ids = tokens()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert any(TRAIN_LANES in m.__dict__ for m in model.modules())
    clone = pickle.loads(pickle.dumps(model))
    assert not any(TRAIN_LANES in m.__dict__ for m in clone.modules())
    torch.testing.assert_close(clone(input_ids=ids, labels=ids).loss, loss, atol=0, rtol=0)
    model.to("cpu")
    assert not any(TRAIN_LANES in m.__dict__ for m in model.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "int8"])
def test_decode_lane_on_gpu_equals_the_op_for_any_row_layout(tiny_llama_path, quant):
    """Compiled kernels: the lane's direct launch, rows of another alignment or stride (the general launch), a CUDA
    graph of the lane; every output bit-identical to `fastlora_linear` on the same rows."""
    from peft_fastlora import ops

    layer = first_layer(get_peft_model(quantized(tiny_llama_path, quant), fast_config()).eval())
    k, dtype = layer.in_features, FP16 if quant == "int8" else BF16
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight

    def op(x):
        return ops.fastlora_linear(x, layer.quantized_weight(), None, a, b, layer.scaling["default"])

    wide = torch.randn(2, 2 * k + 1, device="cuda", dtype=dtype)
    layouts = {
        "contiguous": lambda: torch.randn(2, k, device="cuda", dtype=dtype),
        "unaligned": lambda: wide[:, 1 : k + 1],  # 2-byte offset, row stride 2k + 1
        "strided rows": lambda: wide[:, :k],
    }
    with torch.no_grad():
        for name in ["contiguous", "unaligned", "contiguous", "strided rows", "contiguous"]:
            wide.normal_()
            x = layouts[name]()
            assert torch.equal(layer(x), op(x)), name
        static_x = torch.randn(2, k, device="cuda", dtype=dtype)
        layer(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        for _ in range(2):
            static_x.normal_()
            graph.replay()
            assert torch.equal(static_y, op(static_x))


@pytest.mark.gpu
def test_eager_generate_with_decode_lanes_equals_the_general_path(tiny_llama_path, monkeypatch):
    from peft_fastlora import ops
    from peft_fastlora.layer import DECODE_LANES

    model = get_peft_model(quantized(tiny_llama_path, "nf4"), fast_config()).eval()
    ids = tokens().cuda()
    kwargs = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        laned = model.generate(input_ids=ids, **kwargs)
    assert any(DECODE_LANES in m.__dict__ for m in model.modules())
    for module in model.modules():
        module.__dict__.pop(DECODE_LANES, None)
    monkeypatch.setattr(ops, "prepare_small_m_call", lambda *args: None)
    with torch.no_grad():
        general = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(laned.sequences, general.sequences)
    for got, expected in zip(laned.scores, general.scores):
        assert torch.equal(got, expected)


def test_a_model_with_decode_lanes_pickles_and_deep_copies(tiny_llama_path, prepares):
    import copy
    import pickle

    from peft_fastlora.layer import DECODE_LANES

    model = _lane_model(tiny_llama_path)
    ids = tokens()
    with torch.no_grad():
        model(input_ids=ids[:, :1])  # one row per sequence: every layer builds a lane
        expected = model(input_ids=ids[:, :1]).logits
    assert any(DECODE_LANES in m.__dict__ for m in model.modules())
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert not any(DECODE_LANES in m.__dict__ for m in clone.modules())
        with torch.no_grad():
            assert torch.equal(clone(input_ids=ids[:, :1]).logits, expected)
        assert any(DECODE_LANES in m.__dict__ for m in clone.modules())
