"""The fast path's fused loss (``peft_fastlora/fused_loss.py``) on whole models: the same loss and gradients as the
model's own head + loss (within bf16 rounding: the tiny models compute in bf16), without calling the LM head; the
model's own forward wherever the fused one does not apply."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from peft import get_peft_model

from peft_fastlora.fused_loss import apply_fused_loss, fused_loss_refusal
from peft_fastlora.ops import FORCE_TRITON_ENV
from tests.utils import fast_config, load_quantized, tokens


def _model(path, seed: int = 5, **config):
    torch.manual_seed(seed)
    model = get_peft_model(load_quantized(path), fast_config(**{"lora_alpha": 8, **config}))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B = 0 would hide the LoRA term from every comparison
            torch.nn.init.normal_(param, std=0.05)
    return model


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(got, expected):
    (out, grads), (out_ref, grads_ref) = got, expected
    torch.testing.assert_close(out.loss, out_ref.loss, atol=1e-4, rtol=1e-4)
    assert grads.keys() == grads_ref.keys() and grads
    for name, grad in grads_ref.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads[name], grad, atol=2e-2 * scale, rtol=2e-2, msg=name)


def _head_never_called(model):
    def refuse(*args, **kwargs):
        raise AssertionError("the LM head ran: the logits were materialised")

    model.get_base_model().lm_head.forward = refuse


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("ckpt", ["off", "non-reentrant", "reentrant"])
def test_same_loss_and_gradients_without_the_logits(tiny_llama_path, monkeypatch, path, ckpt):
    if path == "triton" and not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    plain, fused = _model(tiny_llama_path), _model(tiny_llama_path)
    assert apply_fused_loss(fused.get_base_model())
    for model in (plain, fused):
        model.train()
        if ckpt != "off":
            model.get_base_model().gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    ids = tokens(rows=2, seq=12)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that does not count
    expected = _loss_and_grads(plain, ids, labels=labels)
    _head_never_called(fused)
    got = _loss_and_grads(fused, ids, labels=labels)
    assert got[0].logits is None
    _assert_same_training(got, expected)


def test_num_items_in_batch_and_shift_labels(tiny_llama_path):
    """transformers' gradient-accumulation divisor and pre-shifted labels are honoured as the model's loss does."""
    plain, fused = _model(tiny_llama_path).train(), _model(tiny_llama_path).train()
    apply_fused_loss(fused.get_base_model())
    ids = tokens(rows=2, seq=10)
    shifted = torch.roll(ids, -1, dims=1)
    shifted[:, -1] = -100
    for kwargs in (dict(labels=ids, num_items_in_batch=torch.tensor(7)), dict(labels=ids, shift_labels=shifted)):
        _assert_same_training(_loss_and_grads(fused, ids, **kwargs), _loss_and_grads(plain, ids, **kwargs))


def test_evaluation_generation_and_no_labels_run_the_models_forward(tiny_llama_path):
    plain, fused = _model(tiny_llama_path), _model(tiny_llama_path)
    apply_fused_loss(fused.get_base_model())
    ids = tokens(rows=1, seq=5)
    with torch.no_grad():
        for mode in ("train", "eval"):
            getattr(plain, mode)(), getattr(fused, mode)()
            assert torch.equal(fused(input_ids=ids, labels=ids).logits, plain(input_ids=ids, labels=ids).logits)
    fused.train()
    assert fused(input_ids=ids).logits is not None  # no labels: nothing to fuse
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    plain.eval(), fused.eval()
    with torch.inference_mode():
        assert torch.equal(fused.generate(input_ids=ids, **kwargs), plain.generate(input_ids=ids, **kwargs))


def test_a_head_wrapped_later_keeps_its_adapter(tiny_llama_path):
    """Applied before `get_peft_model` puts LoRA on lm_head: each call checks the head, so the LoRA head trains through
    the model's own forward."""
    torch.manual_seed(5)
    base = load_quantized(tiny_llama_path)
    assert apply_fused_loss(base)
    model = get_peft_model(base, fast_config(lora_alpha=8, target_modules=["q_proj", "lm_head"])).train()
    ids = tokens(rows=2, seq=8)
    out, grads = _loss_and_grads(model, ids, labels=ids)
    assert out.logits is not None and any("lm_head" in name for name in grads)
    assert fused_loss_refusal(base) is not None


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5),
                                          ("num_local_experts", 4)])  # fmt: skip
def test_models_whose_logits_are_not_the_head_output_are_left_alone(tiny_llama_path, field, value):
    model = load_quantized(tiny_llama_path)
    setattr(model.config, field, value)
    forward = model.forward
    assert field in fused_loss_refusal(model) and not apply_fused_loss(model)
    assert model.forward == forward


def test_copies_train_with_their_own_weights(tiny_llama_path):
    """deepcopy and pickle rebind the fused forward and the forward it wraps to the copy: a copy whose adapters
    changed gives its own loss, not the original's."""
    model = _model(tiny_llama_path).train()
    apply_fused_loss(model.get_base_model())
    ids = tokens(rows=2, seq=8)
    loss = model(input_ids=ids, labels=ids).loss
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        base = copied.get_base_model()
        assert base.forward.__self__ is base
        with torch.no_grad():
            for name, param in copied.named_parameters():
                if "lora_B" in name:
                    param.mul_(3)
        assert not torch.allclose(copied(input_ids=ids, labels=ids).loss, loss)
        assert torch.equal(model(input_ids=ids, labels=ids).loss, loss)


def test_trainer_with_gradient_accumulation_logs_the_same_losses(tiny_llama_path, tmp_path):
    """The HF Trainer with gradient accumulation passes ``num_items_in_batch`` to the model: through the fast path's
    fused loss the logged losses and gradient norms match the model's own loss within bf16 rounding, with a
    prompt-like prefix of every row masked out of the labels. (The Trainer keeps only the batch columns the forward
    names: with a bare ``(*args, **kwargs)`` signature it dropped ``input_ids``.)"""
    from transformers import Trainer, TrainingArguments

    from tests.safety.helpers import trainer_kwargs

    ids = tokens(rows=8, seq=12, seed=3)
    labels = ids.clone()
    labels[:, :5] = -100
    rows = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]
    runs = {}
    for fused in (False, True):
        model = _model(tiny_llama_path)
        if fused:
            assert apply_fused_loss(model.get_base_model())
        args = TrainingArguments(**{**trainer_kwargs(tmp_path / str(fused), "cpu", "bf16", steps=2),
                                    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        assert trainer.model_accepts_loss_kwargs  # so num_items_in_batch reaches the fused loss
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        runs[fused] = torch.tensor([[float(h["loss"]), float(h["grad_norm"])] for h in logs])
    assert runs[True].shape == (2, 2)
    torch.testing.assert_close(runs[True], runs[False], atol=2e-3, rtol=2e-2)  # (loss, grad norm) per step
