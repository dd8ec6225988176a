"""Activations, quant_state and adapters in different dtypes: W is dequantized to the activation dtype, always.

Bugs guarded here (each shipped in a QLoRA stack):
- a dequant that returns the quant_state dtype (bf16) under fp16 activations, which breaks the matmul or backward;
- a process-global dequant buffer or cache keyed by device only: the second model in another dtype crashes or reads
  the first model's buffer;
- fp32 activations (norms kept in fp32 via ``_keep_in_fp32_modules``) meeting bf16 weights or bf16 LoRA weights:
  "expected mat1 and mat2 to have the same dtype", or a silent downcast to bf16;
- autocast / inference_mode paths that break or disagree with the eager result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from peft_fastlora.ops.reference import lora_linear_ref

from .conftest import CUDA
from .helpers import (
    WeightDtypeSpy,
    assert_all_finite,
    copy_adapters,
    fastlora,
    fastlora_layers,
    fp32_reference_ops,
    load,
    random_batch,
    randomize_adapters,
    relative_error,
    stock_lora,
    train_steps,
    trainable,
)

# Max relative error (Frobenius, against an fp32 computation) of one layer's output, by activation dtype: a few units
# of the dtype's rounding (fp16 2^-11, bf16 2^-8), over a K <= 128 reduction.
LAYER_RTOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


def _layer_rtol(x_dtype: torch.dtype, layer) -> float:
    """LAYER_RTOL, loosened for bf16 adapters: the LoRA term (~5% of the output here) may be computed in bf16."""
    bf16_adapters = layer.lora_A["default"].weight.dtype == torch.bfloat16
    return max(LAYER_RTOL[x_dtype], 5e-3 if bf16_adapters else 0.0)


def _layer_inputs_outputs(model):
    """Registers hooks recording (input dtype, output dtype) of every FastLoRA layer; returns the record list."""
    seen = []
    for _, layer in fastlora_layers(model):
        layer.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)) and None)
    return seen


def _layer_case(layer, x_dtype: torch.dtype, device: str):
    x = torch.randn(3, 5, layer.in_features, dtype=x_dtype, device=device)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    bias = layer.get_base_layer().bias
    ref = lora_linear_ref(x.float(), layer.quantized_weight(), None if bias is None else bias.float(), a.float(),
                          b.float(), layer.scaling["default"])
    return x, ref


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["model_bf16", "model_fp16"])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["x_fp16", "x_bf16", "x_fp32"])
def test_layer_dequantizes_to_activation_dtype(tiny_llama_path, device_path, bits, model_dtype, x_dtype):
    """Any activation dtype into a layer loaded in any dtype: out.dtype == x.dtype, and the weight the matmul sees is
    in x.dtype (never the quant_state / model dtype); forward and backward match an fp32 computation."""
    model = fastlora(load(tiny_llama_path, model_dtype, device_path, bits=bits, compute_dtype=model_dtype))
    randomize_adapters(model)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    x, ref = _layer_case(layer, x_dtype, device_path)
    x.requires_grad_(True)
    with WeightDtypeSpy(layer.out_features, layer.in_features) as spy:
        y = layer(x)
        y.float().square().sum().backward()
    assert y.dtype == x_dtype
    assert relative_error(y, ref) < _layer_rtol(x_dtype, layer)
    # The base matmuls (forward and the dx of backward) ran on a weight in the activation dtype, and no weight-sized
    # tensor was ever materialized in another 16-bit dtype (fp32 is the dequant math of the reference path).
    assert spy.matmul_dtypes() == {x_dtype}
    assert spy.dtypes() <= {x_dtype, torch.float32}
    assert x.grad.dtype == x_dtype and torch.isfinite(x.grad).all()
    for param in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
        assert param.grad is not None and param.grad.dtype == param.dtype and torch.isfinite(param.grad).all()


def test_weight_spy_sees_stock_peft_dequantize_to_quant_state_dtype(parity_llama_path, device):
    """The probe above can fail: stock PEFT on bitsandbytes computes an fp16 input in the bf16 quant_state dtype."""
    model = stock_lora(load(parity_llama_path, torch.float16, device, compute_dtype=torch.bfloat16))
    model.train()
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features, dtype=torch.float16, device=device, requires_grad=True)
    with WeightDtypeSpy(layer.out_features, layer.in_features) as spy:
        layer(x).float().sum().backward()
    assert torch.bfloat16 in spy.dtypes()


def _fp16_model_with_bf16_quant_state(path, device: str, where: str):
    """A 4-bit model that runs in fp16 while its quantized layers say bf16.

    ``where="compute_dtype"``: loaded in fp16 with ``bnb_4bit_compute_dtype=bf16``. ``where="quant_state"``: loaded
    in bf16 (so each ``quant_state.dtype`` is bf16, as in a pre-quantized bf16 checkpoint), then every float
    parameter cast to fp16.
    """
    if where == "compute_dtype":
        model = load(path, torch.float16, device, compute_dtype=torch.bfloat16)
        assert all(m.compute_dtype == torch.bfloat16 for m in model.modules() if hasattr(m, "compute_dtype"))
        return model
    model = load(path, torch.bfloat16, device, compute_dtype=torch.bfloat16)
    for param in model.parameters():
        if param.dtype == torch.bfloat16:
            param.data = param.data.to(torch.float16)
    assert model.model.layers[0].mlp.down_proj.weight.quant_state.dtype == torch.bfloat16
    return model


@pytest.mark.parametrize("where", ["compute_dtype", "quant_state"])
def test_fp16_activations_with_bf16_quant_state(tiny_llama_path, device_path, where):
    """A model run in fp16 whose 4-bit layers carry bf16 (their compute dtype, or their quant_state dtype): forward
    and backward succeed, every layer computes in fp16, and its weight is dequantized to fp16."""
    model = fastlora(_fp16_model_with_bf16_quant_state(tiny_llama_path, device_path, where))
    randomize_adapters(model)
    model.train()
    seen = _layer_inputs_outputs(model)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    ids = random_batch(batch=3, device=device_path)  # 48 tokens: no activation is shaped like a weight
    with WeightDtypeSpy(layer.out_features, layer.in_features) as spy:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.logits.dtype == torch.float16
    assert torch.isfinite(out.loss)
    assert set(seen) == {(torch.float16, torch.float16)}
    assert spy.matmul_dtypes() == {torch.float16}
    assert torch.bfloat16 not in spy.dtypes()
    assert layer.dequantized_weight(torch.float16).dtype == torch.float16
    grads = {name: p.grad for name, p in trainable(model).items()}
    assert_all_finite(grads)
    assert all(g.abs().sum() > 0 for name, g in grads.items() if "lora_B" in name)
    # The base output is x @ dequant(W, fp16).T exactly as torch computes it.
    x = torch.randn(4, layer.in_features, dtype=torch.float16, device=device_path)
    with torch.no_grad(), model.disable_adapter():
        expected = F.linear(x, layer.dequantized_weight(torch.float16))
        torch.testing.assert_close(layer(x), expected, atol=2e-3, rtol=2e-3)


def _keep_norms_in_fp32(monkeypatch) -> None:
    """What a model class with ``_keep_in_fp32_modules_strict = ["norm", "lm_head"]`` gets from from_pretrained."""
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["norm", "lm_head"], raising=False)


def _cast_kept_modules(model) -> None:
    # Older transformers may ignore the strict list for bf16; do by hand what it would do, so the test is the same.
    for name, module in model.named_modules():
        if name.endswith("norm") or name.endswith("lm_head"):
            module.float()


@pytest.mark.parametrize("adapter_dtype", ["fp32-if-fp16", "fp32"])
def test_fp32_inputs_into_bf16_model(parity_llama_path, device, monkeypatch, adapter_dtype):
    """Norms (and lm_head) kept in fp32 in a bf16 4-bit model feed fp32 activations to every quantized layer: no
    "mat1 and mat2 must have the same dtype", output dtype == input dtype, and the logits match an fp32 computation
    (weights dequantized to fp32, LoRA in fp32) -- where stock PEFT computes in bf16 and does not."""
    _keep_norms_in_fp32(monkeypatch)
    base = load(parity_llama_path, torch.bfloat16, device, compute_dtype=torch.bfloat16)
    _cast_kept_modules(base)
    model = fastlora(base, adapter_dtype=adapter_dtype)
    adapter_dtype_resolved = next(iter(trainable(model).values())).dtype
    assert adapter_dtype_resolved == (torch.bfloat16 if adapter_dtype == "fp32-if-fp16" else torch.float32)
    randomize_adapters(model)
    model.train()
    seen = _layer_inputs_outputs(model)
    ids = random_batch(device=device)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert set(seen) == {(torch.float32, torch.float32)}
    assert out.logits.dtype == torch.float32
    assert_all_finite({name: p.grad for name, p in trainable(model).items()})
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with fp32_reference_ops(monkeypatch):
            reference = model(input_ids=ids).logits
    # fp32 adapters: fp32 all the way, only summation order differs. bf16 adapters: the LoRA term may be computed
    # from bf16-rounded activations (reference path) -- rounding of a term that is ~5% of the output.
    tol = 1e-5 if adapter_dtype == "fp32" else 1e-2
    fast_err = relative_error(logits, reference)
    assert fast_err < tol
    if adapter_dtype != "fp32":
        return

    # Stock PEFT on the same base and adapter computes the quantized layers in bf16: far outside that tolerance.
    stock_base = load(parity_llama_path, torch.bfloat16, device, compute_dtype=torch.bfloat16)
    _cast_kept_modules(stock_base)
    stock = stock_lora(stock_base)
    copy_adapters(model, stock)
    stock.train()
    with torch.no_grad():
        stock_err = relative_error(stock(input_ids=ids).logits, reference)
    assert stock_err > 100 * tol, (fast_err, stock_err)


def test_two_models_two_dtypes_one_process(tiny_llama_path, device_path):
    """bf16 model trains a step, then an fp16 model, then the bf16 one again: all succeed, and the fp16 model did not
    change what the bf16 one computes (no process-global buffer or cache keyed by less than (device, dtype))."""
    ids = random_batch(device=device_path)
    bf16_model = fastlora(load(tiny_llama_path, torch.bfloat16, device_path, compute_dtype=torch.bfloat16))
    fp16_model = fastlora(load(tiny_llama_path, torch.float16, device_path, compute_dtype=torch.float16))
    fp32_8bit = fastlora(load(tiny_llama_path, torch.float32, device_path, bits=8))
    for model in (bf16_model, fp16_model, fp32_8bit):
        randomize_adapters(model)

    def probe(model):
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids).logits.clone()

    losses = train_steps(bf16_model, ids, steps=1)
    before = probe(bf16_model)
    losses += train_steps(fp16_model, ids, steps=1)
    assert probe(fp16_model).dtype == torch.float16
    losses += train_steps(fp32_8bit, ids, steps=1)
    after = probe(bf16_model)
    losses += train_steps(bf16_model, ids, steps=1)
    assert before.dtype == torch.bfloat16
    # Bit-identical on CPU; on CUDA allow for cuBLAS picking another algorithm -- a polluted buffer is far off.
    tol = 0 if device_path != CUDA else 1e-2
    torch.testing.assert_close(after, before, atol=tol, rtol=tol)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses), losses
    for model in (bf16_model, fp16_model, fp32_8bit):
        assert_all_finite({name: p for name, p in trainable(model).items()})


@pytest.mark.parametrize(
    "autocast_dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.gpu)], ids=["bf16", "fp16"]
)
def test_autocast_matches_reference(tiny_llama_path, device_path, autocast_dtype):
    """fp32 activations inside ``torch.autocast(dtype)``: each layer computes as ``nn.Linear`` would under autocast
    (inputs cast to the autocast dtype, output in it), matching the reference on those inputs; backward works and the
    adapter grads are finite and in the adapter dtype."""
    if autocast_dtype == torch.float16 and device_path != CUDA:
        pytest.skip("fp16 autocast is the CUDA case; CPU autocast is bf16")
    # bf16 adapters under fp16 autocast are what peft_fastlora.trainer_check rejects (GradScaler); use fp32 there.
    adapter_dtype = "fp32" if autocast_dtype == torch.float16 else "fp32-if-fp16"
    model = fastlora(load(tiny_llama_path, torch.float32, device_path, compute_dtype=torch.bfloat16),
                     adapter_dtype=adapter_dtype)
    randomize_adapters(model)
    model.train()
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    x, _ = _layer_case(layer, torch.float32, device_path)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = lora_linear_ref(x.to(autocast_dtype), layer.quantized_weight(), None, a, b, layer.scaling["default"])
    device_type = torch.device(device_path).type
    ids = random_batch(device=device_path)
    with torch.autocast(device_type, dtype=autocast_dtype):
        y = layer(x)
        loss = model(input_ids=ids, labels=ids).loss
    assert y.dtype == autocast_dtype
    assert relative_error(y, expected) < _layer_rtol(autocast_dtype, layer)
    loss.backward()
    with torch.no_grad():
        fp32_loss = model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - fp32_loss.item()) < 2e-2 * fp32_loss.item()
    for name, param in trainable(model).items():
        assert param.grad is not None and param.grad.dtype == param.dtype, name
    assert_all_finite({name: p.grad for name, p in trainable(model).items()})


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_inference_mode_matches_no_grad(tiny_llama_path, device_path, bits):
    """``torch.inference_mode()`` takes the same path as ``no_grad`` (same logits, same greedy tokens) and matches an
    fp32 computation within the model dtype's rounding."""
    model = fastlora(load(tiny_llama_path, torch.bfloat16, device_path, bits=bits, compute_dtype=torch.bfloat16))
    randomize_adapters(model)
    model.eval()
    ids = random_batch(batch=2, device=device_path)
    gen_kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                      pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(**gen_kwargs)
    with torch.inference_mode():
        logits_im = model(input_ids=ids).logits
        tokens_im = model.generate(**gen_kwargs)
    torch.testing.assert_close(logits_im, logits, atol=1e-2, rtol=1e-2)
    assert torch.equal(tokens_im, tokens)
    layer = model.base_model.model.model.layers[1].mlp.up_proj
    x, ref = _layer_case(layer, torch.bfloat16, device_path)
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, ref) < _layer_rtol(torch.bfloat16, layer)
