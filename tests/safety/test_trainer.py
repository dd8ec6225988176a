"""HF ``Trainer`` on 4-bit and 8-bit FastLoRA models, in bf16 and fp16 mixed precision.

Bugs guarded here:
- fp16 training (GradScaler) with bf16 or fp16 trainable adapters: GradScaler dies at the first optimizer step with
  "Attempting to unscale FP16 gradients." or, on CUDA, "_amp_foreach_non_finite_check_and_unscale_cuda" not
  implemented for 'BFloat16' -- messages that name neither the adapter nor the fix. FastLoRA's default policy gives
  fp32 adapters under fp16 compute, and `peft_fastlora.trainer_check` turns the bad case into one clear ValueError.
- a quantized model that trains with NaN losses or never lowers its loss under mixed precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from peft_fastlora.trainer_check import (
    FastLoraFp16Callback,
    check_fp16_training,
    effective_trainable_dtypes,
    register_fp16_autocast_check,
    remove_fp16_autocast_check,
)

from .conftest import CPU, CUDA
from .helpers import fastlora, load, stock_lora, token_batch, trainable, trainer_kwargs

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

STEPS = 20
MAX_SKIPPED_STEPS = 3  # GradScaler may skip the first steps while it finds its scale; more means overflowing grads
MIN_LOSS_DROP = 0.3  # memorizing one repeated 16-token sequence at lr 1e-2: ~4.9 -> ~3.9 in 20 steps


class SkippedSteps(TrainerCallback):
    """Counts the optimizer steps that GradScaler skipped (inf/NaN gradients)."""

    def __init__(self):
        self.skipped = 0

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.skipped += int(bool(getattr(optimizer, "step_was_skipped", False)))


def _dataset() -> list[dict[str, torch.Tensor]]:
    ids = token_batch(batch=32)
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(tmp_path, device: str, precision: str, steps: int = STEPS) -> TrainingArguments:
    return TrainingArguments(**trainer_kwargs(tmp_path, device, precision, steps))


def _train(model, tmp_path, device: str, precision: str, callbacks=()):
    skipped = SkippedSteps()
    trainer = Trainer(model=model, args=_args(tmp_path, device, precision), train_dataset=_dataset(),
                      callbacks=[skipped, *callbacks])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], skipped.skipped


def _assert_trained(losses: list[float], grad_norms: list[float], skipped: int) -> None:
    assert len(losses) == STEPS
    assert all(math.isfinite(v) for v in losses + grad_norms), (losses, grad_norms)
    assert skipped <= MAX_SKIPPED_STEPS, skipped
    assert sum(losses[-5:]) / 5 < losses[0] - MIN_LOSS_DROP, losses


def _load(path, device: str, bits: int, dtype: torch.dtype):
    return load(path, dtype, device, bits=bits, compute_dtype=dtype)


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_trainer_bf16(tiny_llama_path, tmp_path, device, bits):
    """``Trainer(bf16=True)``, ``adapter_dtype="bf16"``: finite loss and grad norm, loss falls, adapters stay bf16."""
    model = fastlora(_load(tiny_llama_path, device, bits, torch.bfloat16), adapter_dtype="bf16")
    _assert_trained(*_train(model, tmp_path, device, "bf16"))
    assert {p.dtype for p in trainable(model).values()} == {torch.bfloat16}


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_trainer_fp16(tiny_llama_path, tmp_path, monkeypatch, bits):
    """``Trainer(fp16=True)`` (autocast + GradScaler) with ``adapter_dtype="fp32-if-fp16"`` on an fp16 model: fp32
    adapters, finite loss and grad norm, loss falls, at most a few skipped steps. GPU only: on CPU, accelerate runs
    ``fp16=True`` without autocast or GradScaler (see `test_fp16_autocast_gradscaler_loop` for the CPU AMP path)."""
    device = CUDA
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    model = fastlora(_load(tiny_llama_path, device, bits, torch.float16), adapter_dtype="fp32-if-fp16")
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}
    _assert_trained(*_train(model, tmp_path, device, "fp16", callbacks=[FastLoraFp16Callback()]))
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}


def _fp16_trainer_with_bf16_adapters(path, tmp_path, device, callbacks=()):
    model = fastlora(_load(path, device, 4, torch.float16), adapter_dtype="bf16")
    trainer = Trainer(model=model, args=_args(tmp_path, device, "fp16", steps=2), train_dataset=_dataset(),
                      callbacks=list(callbacks))
    return model, trainer


def _assert_clear_error(err: pytest.ExceptionInfo) -> None:
    message = str(err.value)
    assert "adapter_dtype='bf16'" in message and "fp32-if-fp16" in message and "bf16=True" in message
    assert "lora_A" in message
    assert "Attempting to unscale" not in message


def test_bf16_policy_under_fp16_training_callback_raises(tiny_llama_path, tmp_path, device):
    """``adapter_dtype="bf16"`` with ``Trainer(fp16=True)``: `FastLoraFp16Callback` stops training before the first
    step with a ValueError that names ``adapter_dtype`` and the fix."""
    model, trainer = _fp16_trainer_with_bf16_adapters(tiny_llama_path, tmp_path, device, [FastLoraFp16Callback()])
    with pytest.raises(ValueError) as err:
        trainer.train()
    _assert_clear_error(err)
    assert trainer.state.global_step == 0


@pytest.mark.gpu
def test_bf16_policy_under_fp16_training_forward_check_raises(tiny_llama_path, tmp_path, monkeypatch):
    """The same without a callback: the forward pre-hook of `register_fp16_autocast_check` (on the tuner, as
    FastLoraModel can register it) raises at the first training forward under the Trainer's fp16 autocast. (CUDA:
    accelerate uses no autocast for fp16 on CPU; the CPU version is `test_fp16_autocast_gradscaler_loop_...`.)"""
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    model, trainer = _fp16_trainer_with_bf16_adapters(tiny_llama_path, tmp_path, CUDA)
    register_fp16_autocast_check(model.base_model)
    with pytest.raises(ValueError) as err:
        trainer.train()
    _assert_clear_error(err)
    assert trainer.state.global_step == 0


@pytest.mark.gpu
def test_gradscaler_rejects_bf16_adapters_without_the_check(tiny_llama_path, tmp_path, monkeypatch):
    """What the check prevents: on CUDA, GradScaler fails on bf16 adapter gradients with its own internal message."""
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    model, trainer = _fp16_trainer_with_bf16_adapters(tiny_llama_path, tmp_path, CUDA)
    remove_fp16_autocast_check(model.base_model)  # in case FastLoraModel registered it
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)) as err:
        trainer.train()
    assert "BFloat16" in str(err.value) or "unscale" in str(err.value), str(err.value)
    assert "adapter_dtype" not in str(err.value)


@pytest.mark.gpu
def test_gradscaler_rejects_stock_bf16_lora(tiny_llama_path, tmp_path, monkeypatch):
    """The same failure with stock PEFT: bf16 LoRA weights (``autocast_adapter_dtype=False``) under fp16 training."""
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    model = stock_lora(_load(tiny_llama_path, CUDA, 4, torch.bfloat16), autocast_adapter_dtype=False)
    assert {p.dtype for p in trainable(model).values()} == {torch.bfloat16}
    trainer = Trainer(model=model, args=_args(tmp_path, CUDA, "fp16", steps=2), train_dataset=_dataset())
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)) as err:
        trainer.train()
    assert "BFloat16" in str(err.value) or "unscale" in str(err.value), str(err.value)


def _amp_loop(model, device: str, steps: int) -> tuple[list[float], int]:
    """A hand-written fp16 AMP loop (autocast + GradScaler + clipping); returns the losses and the skipped steps."""
    ids = token_batch(batch=4, device=device)
    params = list(trainable(model).values())
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler(device)
    model.train()
    losses, skipped = [], 0
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.get_scale() < scale)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, skipped


def test_fp16_autocast_gradscaler_loop(tiny_llama_path, device):
    """fp16 autocast + GradScaler by hand on an fp16 4-bit model with the default policy: fp32 adapters, trains."""
    model = fastlora(_load(tiny_llama_path, device, 4, torch.float16))
    register_fp16_autocast_check(model.base_model)
    losses, skipped = _amp_loop(model, device, STEPS)
    assert all(math.isfinite(v) for v in losses), losses
    assert skipped <= MAX_SKIPPED_STEPS
    assert sum(losses[-5:]) / 5 < losses[0] - MIN_LOSS_DROP, losses
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}


def test_gradscaler_rejects_stock_fp16_lora(tiny_llama_path, device):
    """What goes wrong without the policy, on any device: stock PEFT LoRA weights left in fp16
    (``autocast_adapter_dtype=False`` on an fp16 model) meet GradScaler's "Attempting to unscale FP16 gradients"."""
    model = stock_lora(_load(tiny_llama_path, device, 4, torch.float16), autocast_adapter_dtype=False)
    assert {p.dtype for p in trainable(model).values()} == {torch.float16}
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _amp_loop(model, device, 1)


def test_fp16_autocast_gradscaler_loop_with_bf16_policy_raises(tiny_llama_path, device):
    """``adapter_dtype="bf16"`` in that loop: the forward check raises the clear error at the first step (on CPU the
    loop would otherwise run, since CPU GradScaler unscales bf16; on CUDA it would die inside GradScaler)."""
    model = fastlora(_load(tiny_llama_path, device, 4, torch.float16), adapter_dtype="bf16")
    register_fp16_autocast_check(model.base_model)
    with pytest.raises(ValueError) as err:
        _amp_loop(model, device, 1)
    _assert_clear_error(err)


def test_check_reads_the_policy_dtype_not_an_outside_cast(tiny_llama_path):
    """A trainer that casts fp32-policy adapters to bf16 (TRL does) is no error: the next forward restores fp32."""
    model = fastlora(_load(tiny_llama_path, CPU, 4, torch.float16))
    check_fp16_training(model)
    for param in trainable(model).values():
        param.data = param.data.to(torch.bfloat16)
    assert set(effective_trainable_dtypes(model).values()) == {torch.float32}
    check_fp16_training(model)


def test_check_names_other_trainable_parameters(tiny_llama_path):
    """Trainable parameters outside FastLoRA layers (modules_to_save, plain-LoRA targets) are checked as they are."""
    model = fastlora(_load(tiny_llama_path, CPU, 4, torch.float16), modules_to_save=["lm_head"])
    head = [name for name in trainable(model) if "lm_head" in name]
    assert head and all(trainable(model)[name].dtype == torch.float16 for name in head)
    with pytest.raises(ValueError, match="lm_head"):
        check_fp16_training(model)


def test_forward_check_runs_once_and_only_under_fp16_autocast(tiny_llama_path):
    """The hook does nothing in eval / no-grad forwards, checks the first training forward, then removes itself."""
    model = fastlora(_load(tiny_llama_path, CPU, 4, torch.float16), adapter_dtype="bf16")
    handle = register_fp16_autocast_check(model.base_model)
    assert register_fp16_autocast_check(model.base_model) is handle  # idempotent
    ids = token_batch(batch=2)
    model.eval()
    with torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids)  # eval: not a training step
    model.train()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids)  # no grad: not a training step
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="adapter_dtype"):
        model(input_ids=ids)
    model(input_ids=ids)  # removed after its one check
    handle = register_fp16_autocast_check(model.base_model)
    model(input_ids=ids)  # a bf16-policy model trained without fp16 autocast: no error, hook removed
    assert model.base_model._forward_pre_hooks.get(handle.id) is None


def test_default_policy_gives_fp32_adapters_when_activations_are_fp16(tiny_llama_path):
    """fp16 model, ``bnb_4bit_compute_dtype=bf16``: the layers compute in fp16, so the default policy must give fp32."""
    model = fastlora(load(tiny_llama_path, torch.float16, CPU, compute_dtype=torch.bfloat16))
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}


def test_fp16_check_does_not_recommend_the_policy_in_use(tiny_llama_path):
    """fp32-if-fp16 on a bf16-compute model gives bf16 adapters: the error explains why and suggests other fixes."""
    model = fastlora(load(tiny_llama_path, torch.bfloat16, compute_dtype=torch.bfloat16))
    with pytest.raises(ValueError) as err:
        check_fp16_training(model)
    message = str(err.value)
    assert "'fp32-if-fp16' gives fp32 adapters only to layers that compute in fp16" in message
    assert "(the default)" not in message and "adapter_dtype='fp32'" in message and "bf16=True" in message
