"""``peft_fastlora.distributed`` in one process: the FSDP dtype rule, the quant_state recovery, the adapter save."""

import logging
import warnings

import pytest
import torch
from peft import get_peft_model
from torch import nn

import peft_fastlora
from peft_fastlora.bnb import FastLoraLinear4bit
from peft_fastlora.distributed import (
    FSDPConfigError,
    fsdp_wraps_adapters,
    install_quant_state_hooks,
    maybe_prepare_for_fsdp,
    prepare_for_fsdp,
    restore_quant_state,
    save_adapter,
)
from tests.utils import load_quantized

LOGGER = "peft_fastlora.distributed"


def _peft_model(path, dtype=torch.bfloat16, storage=torch.bfloat16, adapter_dtype="fp32", **config):
    base = load_quantized(path, dtype, compute_dtype=dtype, quant_storage=storage)
    cfg = peft_fastlora.FastLoraConfig(r=4, target_modules="all-linear", adapter_dtype=adapter_dtype, **config)
    return get_peft_model(base, cfg)


def _trainable_dtypes(model):
    return {p.dtype for p in model.parameters() if p.requires_grad}


def _first_4bit_layer(model) -> FastLoraLinear4bit:
    return next(m for m in model.modules() if isinstance(m, FastLoraLinear4bit))


def test_uint8_storage_fails_before_training(tiny_llama_path):
    model = _peft_model(tiny_llama_path, storage=torch.uint8)
    with pytest.raises(FSDPConfigError, match=r"`bnb_4bit_quant_storage` is torch\.uint8") as info:
        prepare_for_fsdp(model)
    assert "bnb_4bit_quant_storage=torch.bfloat16" in str(info.value)  # the fix
    assert _trainable_dtypes(model) == {torch.float32}  # nothing changed


def test_non_strict_logs_instead(tiny_llama_path, caplog):
    model = _peft_model(tiny_llama_path, storage=torch.uint8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, strict=False)
    assert len(caplog.records) == 1 and "bnb_4bit_quant_storage" in caplog.records[0].getMessage()
    assert _trainable_dtypes(model) == {torch.float32}


def test_adapters_take_storage_dtype_with_one_log_line(tiny_llama_path, caplog):
    model = _peft_model(tiny_llama_path, modules_to_save=["lm_head"])
    assert _trainable_dtypes(model) == {torch.float32, torch.bfloat16}  # fp32 adapters, bf16 lm_head copy
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model)
    assert _trainable_dtypes(model) == {torch.bfloat16}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "adapter_dtype='fp32'" in messages[0] and "torch.float32" in messages[0] and "torch.bfloat16" in messages[0]
    layer = _first_4bit_layer(model)
    assert set(layer.adapter_dtypes.values()) == {torch.bfloat16}

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model)  # idempotent: nothing left to cast, nothing logged
    assert caplog.records == []

    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    assert not [w for w in record if "outside peft_fastlora" in str(w.message)]  # no fight with the adapter policy
    assert _trainable_dtypes(model) == {torch.bfloat16}


def test_frozen_adapters_are_cast_too(tiny_llama_path):
    """An inference-mode adapter (frozen) is flattened with the 4-bit weights all the same."""
    model = _peft_model(tiny_llama_path, inference_mode=True)
    assert _trainable_dtypes(model) == set()
    prepare_for_fsdp(model)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}


def test_frozen_params_in_another_dtype_fail(tiny_llama_path):
    model = _peft_model(tiny_llama_path, dtype=torch.float32, storage=torch.bfloat16)
    with pytest.raises(FSDPConfigError, match=r"Load the model with `dtype=torch\.bfloat16`"):
        prepare_for_fsdp(model)


def test_8bit_layers_fail(tiny_llama_path):
    base = load_quantized(tiny_llama_path, torch.float16, bits=8)
    model = get_peft_model(base, peft_fastlora.FastLoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(FSDPConfigError, match="8-bit"):
        prepare_for_fsdp(model)


def _fsdp_style_weight(base: nn.Module, dtype=None) -> None:
    """What FSDP leaves on the module during forward: a plain Parameter over the (all-gathered) packed bytes."""
    data = base.weight.data.clone()
    base.weight = nn.Parameter(data if dtype is None else data.to(dtype), requires_grad=False)


def test_quant_state_is_restored_after_fsdp_style_replacement(tiny_llama_path):
    model = _peft_model(tiny_llama_path)
    layer = _first_4bit_layer(model)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16)
    expected = layer(x)
    _fsdp_style_weight(layer.get_base_layer())
    assert getattr(layer.get_base_layer().weight, "quant_state", None) is None
    assert install_quant_state_hooks(model) > 0
    assert install_quant_state_hooks(model) == 0  # once only
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)


def test_restore_quant_state_rejects_cast_bytes(tiny_llama_path):
    model = _peft_model(tiny_llama_path)
    base = _first_4bit_layer(model).get_base_layer()
    _fsdp_style_weight(base, torch.float16)  # e.g. FSDP mixed precision param_dtype=fp16 over bf16 storage
    with pytest.raises(RuntimeError, match="bnb_4bit_quant_storage"):
        restore_quant_state(base)


def test_maybe_prepare_for_fsdp_follows_accelerate_env(tiny_llama_path, monkeypatch):
    model = _peft_model(tiny_llama_path)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    maybe_prepare_for_fsdp(model)
    assert _trainable_dtypes(model) == {torch.float32}
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    maybe_prepare_for_fsdp(model)
    assert _trainable_dtypes(model) == {torch.bfloat16}


def test_save_adapter_matches_save_pretrained(tiny_llama_path, tmp_path):
    from tests.distributed.fsdp_worker import compare_saved

    model = _peft_model(tiny_llama_path, modules_to_save=["lm_head"])
    save_adapter(model, tmp_path / "helper")
    model.save_pretrained(tmp_path / "plain")
    result = compare_saved(tmp_path / "helper", tmp_path / "plain")
    assert result["ok"] and result["values"]["exact"], result


def test_fsdp_wraps_adapters_is_false_without_fsdp(tiny_llama_path):
    model = _peft_model(tiny_llama_path)
    assert not fsdp_wraps_adapters(_first_4bit_layer(model), ["default"])


def test_off_device_tensors_names_stray_buffers():
    """The DDP worker's preflight names a buffer left on another device (NCCL cannot broadcast a CPU tensor)."""
    import torch

    from tests.distributed import _common as C

    module = torch.nn.Linear(3, 2)
    assert C.off_device_tensors(module, torch.device("cpu")) == []
    module.register_buffer("counter", torch.zeros((), device="meta"))
    assert C.off_device_tensors(module, torch.device("cpu")) == ["counter (meta)"]


@pytest.mark.parametrize("cuda, storage, warns", [(True, torch.bfloat16, True), (False, torch.bfloat16, False),
                                                  (True, torch.float32, False)])
def test_fsdp2_packed_nan_warning_on_cuda_with_16bit_storage(tiny_llama_path, monkeypatch, cuda, storage, warns):
    """The FSDP2 packed-word rewrite (seen on 2 x H200) is CUDA-only and only hits 16-bit storage: warn exactly then."""
    model = _peft_model(tiny_llama_path, dtype=storage, storage=storage)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_for_fsdp(model)
    hits = [w for w in caught if "FSDP2" in str(w.message) and "NaN" in str(w.message)]
    assert len(hits) == (1 if warns else 0)
