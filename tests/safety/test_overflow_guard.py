"""The opt-in fp16 overflow guard (``FastLoraConfig(fp16_overflow_guard=True)``).

Bug guarded: models trained in bf16 (Gemma-style MLPs especially) produce activations above fp16's 65504; run in
fp16, ``act(gate) * up`` becomes inf, the next projection turns it into inf/NaN, and the loss is NaN from the first
step. The guard clamps each FastLoRA layer's fp16 input and output to the finite range and counts the layers that
needed it (`peft_fastlora.overflow_report`). Off by default, and then the layer does no extra work.

The test model is the tiny Llama with its gate/up projections scaled by 1000 (see conftest), loaded in fp16 with
fp16 compute: silu(gate) * up reaches ~1e5 for a few tokens, so the inf enters each layer's down_proj.
"""

from __future__ import annotations

import math

import pytest
import torch

import peft_fastlora
import peft_fastlora.layer
from peft_fastlora import FastLoraConfig

from .helpers import assert_all_finite, fastlora, load, random_batch, train_steps, trainable

STEPS = 5


def _fp16_model(path, device: str, guard: bool, bits: int = 4, dtype: torch.dtype = torch.float16):
    return fastlora(load(path, dtype, device, bits=bits, compute_dtype=dtype), fp16_overflow_guard=guard)


def _clamp_calls(monkeypatch) -> list[int]:
    """Counts calls of the guard's clamp in FastLoRA layers."""
    calls = []
    real = peft_fastlora.layer.clamp_fp16

    def spy(t, counter):
        calls.append(1)
        return real(t, counter)

    monkeypatch.setattr(peft_fastlora.layer, "clamp_fp16", spy)
    return calls


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_without_guard_fp16_overflow_gives_nan_loss(overflow_llama_path, device, bits):
    """The failure: guard off, the fp16 MLP product overflows and the loss is not finite."""
    model = _fp16_model(overflow_llama_path, device, guard=False, bits=bits)
    ids = random_batch(device=device)
    inputs = []
    down = model.base_model.model.model.layers[0].mlp.down_proj
    down.register_forward_pre_hook(lambda mod, args: inputs.append(torch.isinf(args[0]).any().item()) and None)
    loss = model(input_ids=ids, labels=ids).loss
    assert inputs == [True]  # the overflow happens in the model's MLP, before the FastLoRA layer sees it
    assert not math.isfinite(loss.item())
    assert peft_fastlora.overflow_report(model) == {}


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_guard_trains_with_finite_loss(overflow_llama_path, device, bits):
    """Guard on: finite losses and gradients for several AdamW steps, the loss falls, and `overflow_report` counts
    the clamped tensors in exactly the layers that saw the overflow (every down_proj), once per forward."""
    model = _fp16_model(overflow_llama_path, device, guard=True, bits=bits)
    ids = random_batch(device=device)
    losses = train_steps(model, ids, STEPS, lr=1e-3)
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert_all_finite({name: p for name, p in trainable(model).items()})
    report = peft_fastlora.overflow_report(model)
    assert len(report) == 14  # every FastLoRA layer reports, clamped or not
    clamped = {name for name, count in report.items() if count}
    assert clamped and all(name.endswith("mlp.down_proj") for name in clamped), report
    assert all(report[name] >= STEPS for name in clamped), report


def test_guard_is_off_by_default_and_does_no_work_when_off(overflow_llama_path, monkeypatch):
    """``fp16_overflow_guard`` defaults to False; then, and for non-fp16 activations with it on, no clamp runs."""
    assert FastLoraConfig().fp16_overflow_guard is False
    calls = _clamp_calls(monkeypatch)
    ids = random_batch()
    model = fastlora(load(overflow_llama_path, torch.float16, compute_dtype=torch.float16))
    model(input_ids=ids)
    assert calls == [] and peft_fastlora.overflow_report(model) == {}
    bf16 = _fp16_model(overflow_llama_path, "cpu", guard=True, dtype=torch.bfloat16)
    loss = bf16(input_ids=ids, labels=ids).loss
    assert calls == [] and math.isfinite(loss.item())  # bf16 does not overflow here, and is never clamped
    assert set(peft_fastlora.overflow_report(bf16).values()) == {0}
    fp16 = _fp16_model(overflow_llama_path, "cpu", guard=True)
    fp16(input_ids=ids)
    assert len(calls) == 2 * 14  # input and output of every layer


def test_guard_passes_finite_values_unchanged(tiny_llama_path):
    """On a model that does not overflow, the guard changes nothing: same logits and gradients, zero counts."""
    ids = random_batch()
    results = []
    for guard in (False, True):
        torch.manual_seed(0)
        model = _fp16_model(tiny_llama_path, "cpu", guard=guard)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits, {n: p.grad for n, p in trainable(model).items()}))
        if guard:
            assert set(peft_fastlora.overflow_report(model).values()) == {0}
    (logits_off, grads_off), (logits_on, grads_on) = results
    torch.testing.assert_close(logits_on, logits_off, atol=0, rtol=0)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=0, rtol=0)


def test_guard_counts_on_a_model_built_under_inference_mode(overflow_llama_path):
    """A counter created under `torch.inference_mode()` is an inference tensor; updating it outside would raise."""
    with torch.inference_mode():
        model = _fp16_model(overflow_llama_path, "cpu", guard=True)
    ids = random_batch(2)
    with torch.no_grad():
        model(ids)
    assert sum(peft_fastlora.overflow_report(model).values()) > 0
    before = sum(peft_fastlora.overflow_report(model).values())
    with torch.inference_mode():
        model(ids)  # and back inside it
    model(ids)  # and outside again, with grad mode on
    assert sum(peft_fastlora.overflow_report(model).values()) > before
