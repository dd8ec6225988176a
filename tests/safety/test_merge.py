"""Merging adapters into quantized weights.

``merge_and_unload()`` requantizes ``dequant(W) + delta`` into the 4-bit / 8-bit layer like PEFT does, which loses
most of a small trained delta, and warns that it is lossy. ``merge_and_unload(dequantize=True)`` returns plain
``nn.Linear`` layers in the compute dtype holding ``dequant(W) + delta``: lossless up to that dtype's rounding.

Measured here on the tiny model (relative error of the merged layer's effect ``x @ (W_merged - W).T`` against the
adapter's ``x @ delta.T``, delta RMS = 3% of W's; fp32 math):

| base      | requantizing merge | dequantize=True, fp32 | fp16  | bf16  |
|-----------|--------------------|-----------------------|-------|-------|
| 4-bit NF4 | ~1.06 (all lost)   | ~0                    | ~0.02 | ~0.12 |
| 8-bit     | ~0.20              | ~0                    | ~0.02 | ~0.12 |

Bug guarded: a merge that silently drops the adapter (or adds it twice), a merge that looks lossless but is not, and
a "dequantized" model that cannot be saved and loaded again.
"""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from peft_fastlora import FastLoraConfig, FastLoraLayer
from peft_fastlora.bnb import packed4bit_from_bnb
from peft_fastlora.layer import LOSSY_MERGE_WARNING
from peft_fastlora.ops.reference import dequantize_ref

from .helpers import copy_adapters, fastlora, fastlora_layers, load, random_batch, stock_lora

SMALL_DELTA = 0.03  # RMS of the adapter's delta relative to W's: a typical small fine-tuning update
LARGE_DELTA = 0.3  # large enough that adding it twice, or not at all, is obvious through the requantization noise
# Largest relative error of a requantizing merge/unmerge at LARGE_DELTA (measured: 4-bit ~0.35, 8-bit ~0.02).
ROUND_TRIP_TOL = {4: 0.5, 8: 0.1}
# dequantize=True at SMALL_DELTA: the compute dtype's rounding of W + delta only.
DEQUANT_TOL = {torch.float32: 1e-4, torch.float16: 0.05, torch.bfloat16: 0.25}
REQUANT_MIN_LOSS = {4: 0.8, 8: 0.1}
LOSSY = LOSSY_MERGE_WARNING[:40]


@torch.no_grad()
def set_delta(model, fraction: float, seed: int = 0) -> None:
    """Random lora_B per layer, scaled so that the delta's RMS is ``fraction`` of the dequantized weight's."""
    g = torch.Generator().manual_seed(seed)
    for _, layer in fastlora_layers(model):
        b = layer.lora_B["default"].weight
        b.copy_(torch.randn(b.shape, generator=g))
        w_rms = layer.dequantized_weight(torch.float32).pow(2).mean().sqrt()
        d_rms = layer.get_delta_weight("default").pow(2).mean().sqrt()
        b.mul_((fraction * w_rms / d_rms).to(b.dtype))


def _delta_error(w_merged: torch.Tensor, w: torch.Tensor, delta: torch.Tensor, x: torch.Tensor) -> float:
    """How much of the adapter's effect a merged weight gets wrong, in fp32: ||x (W_m - W - d)^T|| / ||x d^T||."""
    return ((x @ (w_merged.float() - w - delta).T).norm() / (x @ delta.T).norm()).item()


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_dequantized_merge_keeps_a_small_delta(tiny_llama_path, bits, dtype):
    """A small delta survives ``dequantize_and_merge`` (up to the compute dtype's rounding) where the requantizing
    ``merge`` loses most of it."""
    model = fastlora(load(tiny_llama_path, dtype, bits=bits, compute_dtype=dtype), adapter_dtype="fp32")
    set_delta(model, SMALL_DELTA)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    w = layer.dequantized_weight(torch.float32)
    delta = layer.get_delta_weight("default")
    x = torch.randn(64, layer.in_features)

    linear = layer.dequantize_and_merge()
    assert isinstance(linear, nn.Linear) and linear.weight.dtype == dtype and not linear.weight.requires_grad
    dequant_err = _delta_error(linear.weight, w, delta, x)

    with pytest.warns(UserWarning, match=LOSSY):
        layer.merge()
    requant_err = _delta_error(layer.dequantized_weight(torch.float32), w, delta, x)

    assert dequant_err < DEQUANT_TOL[dtype], dequant_err
    assert requant_err > REQUANT_MIN_LOSS[bits], requant_err
    assert requant_err > dequant_err


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_merge_and_unload_dequantize(tiny_llama_path, bits):
    """``merge_and_unload(dequantize=True)``: no FastLoRA or bitsandbytes layer is left, the merged model computes
    what the adapted one did (fp32: to 1e-5), and ``safe_merge`` catches a broken adapter. The requantizing
    ``merge_and_unload()`` warns and keeps quantized layers whose output misses most of the adapter's effect."""
    ids = random_batch()
    errors, merged = {}, {}
    for dequantize in (True, False):
        model = fastlora(load(tiny_llama_path, torch.float32, bits=bits, compute_dtype=torch.float32))
        set_delta(model, SMALL_DELTA)
        model.train()  # keeps bitsandbytes' CPU inference repacking out of the way
        with torch.no_grad():
            with model.disable_adapter():
                base = model(input_ids=ids).logits
            adapted = model(input_ids=ids).logits
        if dequantize:
            merged[dequantize] = model.merge_and_unload(dequantize=True)
        else:
            with pytest.warns(UserWarning, match=LOSSY):
                merged[dequantize] = model.merge_and_unload()
        with torch.no_grad():
            out = merged[dequantize](input_ids=ids).logits
        errors[dequantize] = ((out - adapted).norm() / (adapted - base).norm()).item()
    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    assert not any(isinstance(m, (FastLoraLayer, *quantized)) for m in merged[True].modules())
    assert isinstance(merged[True].model.layers[0].mlp.down_proj, nn.Linear)
    assert errors[True] < 1e-4, errors
    assert isinstance(merged[False].model.layers[0].mlp.down_proj, quantized)
    assert errors[False] > REQUANT_MIN_LOSS[bits] / 2, errors

    broken = fastlora(load(tiny_llama_path, torch.float32, bits=bits, compute_dtype=torch.float32))
    with torch.no_grad():
        broken.base_model.model.model.layers[1].mlp.up_proj.lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        broken.merge_and_unload(dequantize=True, safe_merge=True)


@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("fp4", True)])
def test_requantizing_merge_is_bnb_requantization(parity_llama_path, quant_type, nested):
    """The 4-bit ``merge`` stores exactly what bitsandbytes' quantizer makes of ``dequant(W) + delta`` (same
    blocksize, quant_type, double quantization and quant_state dtype), and loses as much as stock PEFT's merge."""
    model = fastlora(load(parity_llama_path, torch.bfloat16, quant_type=quant_type, double_quant=nested))
    stock = stock_lora(load(parity_llama_path, torch.bfloat16, quant_type=quant_type, double_quant=nested))
    set_delta(model, SMALL_DELTA)
    copy_adapters(model, stock)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    stock_layer = stock.base_model.model.model.layers[0].mlp.down_proj
    state = layer.get_base_layer().weight.quant_state
    exact = layer.dequantized_weight(torch.float32) + layer.get_delta_weight("default")

    with pytest.warns(UserWarning, match=LOSSY):
        layer.merge()
    stock_layer.merge()
    merged = layer.get_base_layer().weight
    data, expected_state = bnb.functional.quantize_4bit(
        exact.to(state.dtype), blocksize=state.blocksize, quant_type=quant_type, compress_statistics=nested
    )
    assert merged.quant_state.quant_type == quant_type and bool(merged.quant_state.nested) == nested
    assert merged.quant_state.dtype == state.dtype
    assert torch.equal(merged.data.view(torch.uint8), data.view(torch.uint8))
    expected = dequantize_ref(packed4bit_from_bnb(data, expected_state), torch.float32)
    torch.testing.assert_close(layer.dequantized_weight(torch.float32), expected, atol=0, rtol=0)

    stock_weight = stock_layer.get_base_layer().weight
    stock_merged = dequantize_ref(packed4bit_from_bnb(stock_weight.data, stock_weight.quant_state), torch.float32)
    ours = (layer.dequantized_weight(torch.float32) - exact).norm()
    theirs = (stock_merged - exact).norm()
    assert 0.5 < (ours / theirs).item() < 2.0, (ours, theirs)


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_merge_unmerge_round_trip(tiny_llama_path, bits):
    """``merge_adapter`` then ``unmerge_adapter``: while merged the output still contains the adapter once (not twice,
    not zero times); after unmerging, the adapter is applied by the layer again and the base is back, each up to
    the requantization noise."""
    model = fastlora(load(tiny_llama_path, torch.float32, bits=bits, compute_dtype=torch.float32))
    set_delta(model, LARGE_DELTA)
    model.train()
    ids = random_batch()
    layers = [layer for _, layer in fastlora_layers(model)]
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits
        with pytest.warns(UserWarning, match=LOSSY):
            model.merge_adapter()
        assert all(layer.merged for layer in layers)
        merged = model(input_ids=ids).logits
        model.unmerge_adapter()
        assert not any(layer.merged for layer in layers)
        unmerged = model(input_ids=ids).logits
        with model.disable_adapter():
            base_after = model(input_ids=ids).logits
    effect = (adapted - base).norm()
    tol = ROUND_TRIP_TOL[bits]
    assert ((merged - adapted).norm() / effect).item() < tol
    assert ((unmerged - adapted).norm() / effect).item() < tol
    assert ((base_after - base).norm() / effect).item() < tol


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_dequantized_merge_runs_in_the_model_dtype(tiny_llama_path, model_dtype):
    """A model run in fp16 (or fp32) whose 4-bit layers say bf16 still runs after ``dequantize=True``, computing what
    the adapted model computed."""
    model = fastlora(load(tiny_llama_path, model_dtype, compute_dtype=torch.bfloat16), adapter_dtype="fp32")
    set_delta(model, SMALL_DELTA)
    model.train()
    ids = random_batch()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload(dequantize=True)
        logits = merged(input_ids=ids).logits
    assert logits.dtype == adapted.dtype
    torch.testing.assert_close(logits, adapted, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_dequantized_merge_saves_and_loads(tiny_llama_path, tmp_path, bits):
    """A model from ``merge_and_unload(dequantize=True)`` is an ordinary model: save, load, same logits (a leftover
    quantization_config made from_pretrained look for bitsandbytes state that is not there)."""
    model = fastlora(load(tiny_llama_path, torch.bfloat16, bits=bits, compute_dtype=torch.bfloat16))
    set_delta(model, SMALL_DELTA)
    merged = model.merge_and_unload(dequantize=True)
    ids = random_batch()
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_merge_of_an_adapter_that_skips_some_layers(tiny_llama_path, bits):
    """`merge_and_unload(dequantize=True, adapter_names=[...])` with an adapter on q_proj only: the other FastLoRA
    layers (created by another adapter) merge nothing for it, as PEFT's requantizing merge does."""
    model = fastlora(load(tiny_llama_path, torch.float32, bits=bits, compute_dtype=torch.float32),
                     init_lora_weights=False)
    model.add_adapter("partial", FastLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    model.set_adapter("partial")
    ids = random_batch(2)
    with torch.no_grad():
        expected = model(ids).logits
    merged = model.merge_and_unload(dequantize=True, adapter_names=["partial"])
    assert not any(isinstance(m, FastLoraLayer) for m in merged.modules())
    with torch.no_grad():
        got = merged(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
