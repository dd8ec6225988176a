"""TRL's ``SFTTrainer`` casts every trainable parameter of a quantized model to bf16 (for QLoRA, following the paper).

Under fp16 training that hands GradScaler bf16 gradients, which it refuses on CUDA. FastLoRA layers restore the
``adapter_dtype`` policy at the next forward, with a warning, keeping the same Parameter objects.

TRL's cast, as of trl 1.16.0 (``trl/trainer/sft_trainer.py``, in ``SFTTrainer.__init__``, after ``get_peft_model`` /
``enable_input_require_grads`` and before the optimizer exists)::

    _is_quantized_model = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    ...
    if _is_quantized_model:
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)

(trl 0.29 has the same loop over ``model.parameters()`` without the DoRA exclusion.) `trl_cast` below is that loop.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from peft_fastlora.layer import FastLoraLayer
from tests.utils import tiny_tokenizer

from .conftest import CPU, CUDA
from .helpers import fastlora, load, recast_warnings, recorded_warnings, token_batch, trainable, trainer_kwargs

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

TRL_CAST_SOURCE = "param.data = param.data.to(torch.bfloat16)"


def trl_cast(model) -> None:
    """TRL SFTTrainer's cast of the trainable parameters of a quantized model, verbatim."""
    _is_quantized_model = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if _is_quantized_model:
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)


def _fp16_model(path, device: str, bits: int = 4):
    return fastlora(load(path, torch.float16, device, bits=bits, compute_dtype=torch.float16))


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["trl-order", "optimizer-first"])
@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
def test_trl_cast_is_undone_at_next_forward(tiny_llama_path, device, bits, optimizer_first):
    """After TRL's cast, the next forward restores the fp32 policy (warning once), the Parameters are the same
    objects (so an optimizer holding them keeps working), and fp16 AMP steps with GradScaler succeed."""
    model = _fp16_model(tiny_llama_path, device, bits)
    params = trainable(model)
    assert {p.dtype for p in params.values()} == {torch.float32}
    ids_before = {name: id(p) for name, p in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2) if optimizer_first else None

    trl_cast(model)
    assert {p.dtype for p in params.values()} == {torch.bfloat16}  # the cast happened

    opt = opt or torch.optim.AdamW(params.values(), lr=1e-2)  # TRL's order: Trainer builds it in train()
    scaler = torch.amp.GradScaler(device)
    ids = token_batch(batch=2, device=device)
    model.train()
    with recorded_warnings("default") as records:
        with torch.autocast(device, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
    assert len(recast_warnings(records)) == 1, recast_warnings(records)
    message = recast_warnings(records)[0]
    assert "torch.bfloat16" in message and "torch.float32" in message and "adapter_dtype" in message
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}
    assert {name: id(p) for name, p in trainable(model).items()} == ids_before
    assert {id(p) for group in opt.param_groups for p in group["params"]} == set(ids_before.values())

    scaler.scale(loss).backward()
    scaler.step(opt)  # unscales fp32 grads: fine on every device
    scaler.update()
    for name, p in trainable(model).items():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert opt.state[p]["exp_avg"].dtype == torch.float32, name
    assert all(p.abs().sum() > 0 for name, p in trainable(model).items() if "lora_B" in name)

    with recorded_warnings("always") as records:
        model(input_ids=ids, labels=ids)
    assert recast_warnings(records) == []  # nothing to restore any more


def test_cast_warns_once_per_model_when_filters_change_mid_forward(tiny_llama_path):
    """One warning for the whole model even when something changes the warning filters during the forward (which
    resets Python's once-per-location memory; on CUDA, code on the forward path does)."""
    import warnings

    model = _fp16_model(tiny_llama_path, CPU)
    trl_cast(model)

    def touch_filters(module, args):
        warnings.filterwarnings("ignore", message="an unrelated message")

    hooks = [layer.register_forward_pre_hook(touch_filters) for layer in model.modules()
             if isinstance(layer, FastLoraLayer)]  # fmt: skip
    ids = token_batch(batch=2)
    with recorded_warnings("default") as records:
        model(input_ids=ids, labels=ids)
    for hook in hooks:
        hook.remove()
    assert len(recast_warnings(records)) == 1, recast_warnings(records)


def test_trl_source_still_casts_to_bf16():
    """The reproduction above is TRL's current code: the installed SFTTrainer still contains the cast."""
    sft_trainer = pytest.importorskip("trl.trainer.sft_trainer")
    assert TRL_CAST_SOURCE in inspect.getsource(sft_trainer.SFTTrainer.__init__)


def _sft_trainer(model, tmp_path, device: str, steps: int, precision: str):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    ids = token_batch(batch=32)
    args = trl.SFTConfig(**trainer_kwargs(tmp_path, device, precision, steps))
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer())


def _sft_run(model, tmp_path, device: str, steps: int, precision: str):
    trainer = _sft_trainer(model, tmp_path, device, steps, precision)
    assert {p.dtype for p in trainable(model).values()} == {torch.bfloat16}  # TRL cast them
    with recorded_warnings("default") as records:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, recast_warnings(records)


@pytest.mark.parametrize("device,precision", [(CPU, "bf16"), pytest.param(CUDA, "fp16", marks=pytest.mark.gpu)],
                         indirect=["device"])
def test_sft_trainer_on_4bit_keeps_the_policy(tiny_llama_path, tmp_path, device, precision):
    """Real ``SFTTrainer`` on a 4-bit fp16 model (fp32 policy): TRL's cast is undone at the first forward, training
    runs with finite, falling losses and ends with fp32 adapters. On CUDA with ``fp16=True`` this is the run that
    GradScaler would kill."""
    steps = 20 if device == CUDA else 8
    model = _fp16_model(tiny_llama_path, device)
    losses, warned = _sft_run(model, tmp_path, device, steps, precision)
    assert len(warned) == 1, warned
    assert {p.dtype for p in trainable(model).values()} == {torch.float32}
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.gpu
def test_sft_trainer_fp16_fails_without_the_restore(tiny_llama_path, tmp_path, monkeypatch):
    """What the restore prevents: with it switched off, TRL's bf16 adapters reach GradScaler on CUDA, which fails."""
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    monkeypatch.setattr(FastLoraLayer, "_restore_adapter_dtypes", lambda self, adapters: None)
    model = _fp16_model(tiny_llama_path, CUDA)
    trainer = _sft_trainer(model, tmp_path, CUDA, 2, "fp16")
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)) as err:
        trainer.train()
    assert "BFloat16" in str(err.value) or "unscale" in str(err.value), str(err.value)
