"""Gradient checkpointing, reentrant and not: LoRA inside checkpointed blocks trains, with the same gradients.

Bug guarded here: with reentrant checkpointing, a block whose inputs do not require grad (frozen embeddings) returns
outputs without grad, so the LoRA weights inside never receive a gradient. Nothing fails when anything trainable sits
outside the blocks: lora_B just stays at its zero init ("LoRA never trains"). A custom autograd Function that drops
its input grads or replays dropout differently on recompute fails the same way, or trains on wrong gradients.
"""

from __future__ import annotations

import pytest
import torch

from .helpers import copy_adapters, fastlora, load, random_batch, trainable

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _enable_checkpointing(model, use_reentrant: bool) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        model.enable_input_require_grads()  # what PEFT's prepare_model_for_kbit_training and TRL do


def _step(model, opt, ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """One forward/backward/step (dropout masks drawn from ``seed``); returns the gradients it applied."""
    torch.manual_seed(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in trainable(model).items() if p.grad is not None}
    opt.step()
    opt.zero_grad()
    return grads


def _untrained(model, kind: str) -> list[str]:
    return [name for name, p in trainable(model).items() if kind in name and not p.detach().abs().sum() > 0]


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_lora_trains_with_the_same_gradients(tiny_llama_path, device_path, use_reentrant):
    """Two steps with and without checkpointing (lora_dropout on, so recompute must replay the RNG): identical
    gradients for every adapter, and after them every lora_B has left its zero init."""
    models = []
    for checkpointing in (False, True):
        model = fastlora(load(tiny_llama_path, torch.bfloat16, device_path, compute_dtype=torch.bfloat16),
                         lora_dropout=0.1)
        if checkpointing:
            copy_adapters(models[0], model)
            _enable_checkpointing(model, use_reentrant)
        model.train()
        models.append(model)
    plain, checkpointed = models
    assert _untrained(checkpointed, "lora_B")  # PEFT's init: B = 0
    ids = random_batch(device=device_path)
    opts = [torch.optim.AdamW(trainable(m).values(), lr=1e-2) for m in models]
    for seed in (1, 2):
        expected = _step(plain, opts[0], ids, seed)
        actual = _step(checkpointed, opts[1], ids, seed)
        assert actual.keys() == expected.keys() == trainable(checkpointed).keys()
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, rtol=1e-2, atol=1e-6, msg=name)
        assert any(g.abs().sum() > 0 for name, g in actual.items() if "lora_B" in name)
    assert _untrained(checkpointed, "lora_B") == []
    assert len([n for n in trainable(checkpointed) if "lora_B" in n]) == 14


def test_never_training_lora_is_detected(tiny_llama_path):
    """The check above can fail: reentrant checkpointing without input grads, with a trainable lm_head adapter outside
    the blocks, runs without error while every lora_B inside the blocks stays zero."""
    model = fastlora(load(tiny_llama_path, torch.bfloat16, "cpu", compute_dtype=torch.bfloat16),
                     target_modules=[*TARGETS, "lm_head"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    base = model.get_base_model()
    if getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()  # newer transformers enable it themselves; undo to get the old behaviour
    model.train()
    opt = torch.optim.AdamW(trainable(model).values(), lr=1e-2)
    ids = random_batch()
    with pytest.warns(UserWarning, match="requires_grad"):
        _step(model, opt, ids, seed=1)
    untrained = _untrained(model, "lora_B")
    assert untrained and all("layers." in name for name in untrained)
    assert not any("lm_head" in name for name in untrained)
