"""``peft_fastlora.distributed`` in one process: the FSDP version, the FSDP2 byte view and the FSDP1 dtype rule, the
quant_state recovery, the adapter save."""

import logging
import warnings

import pytest
import torch
from peft import get_peft_model
from torch import nn

import peft_fastlora
import peft_fastlora.distributed.prepare as D
from peft_fastlora.bnb import FastLoraLinear4bit, restore_quant_state
from peft_fastlora.distributed import (
    FSDPConfigError,
    fsdp2_ignored_params,
    prepare_for_fsdp,
    prepare_if_launched,
    resolve_fsdp_version,
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


def _messages(caplog) -> list[str]:
    """Logged lines, less the one about torch < 2.12 (see `test_fsdp2_ignored_params_on_old_torch`)."""
    return [r.getMessage() for r in caplog.records if "cannot shard uint8 parameters" not in r.getMessage()]


def _packed_weights(model) -> list:
    return [m.get_base_layer().weight for m in model.modules() if isinstance(m, FastLoraLinear4bit)]


def _packed_bytes(model) -> list[torch.Tensor]:
    return [w.data.reshape(-1).view(torch.uint8).clone() for w in _packed_weights(model)]


# ---- fsdp_version ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_accelerate_env(monkeypatch):
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    return monkeypatch


@pytest.mark.parametrize("value", [1, 2])
def test_fsdp_version_argument_wins(no_accelerate_env, value):
    no_accelerate_env.setenv("FSDP_VERSION", str(3 - value))
    assert resolve_fsdp_version(value) == value


@pytest.mark.parametrize("env, use_fsdp, expected", [
    (None, None, 2),  # a direct call: torch's current API, fully_shard
    (None, "true", 1),  # accelerate launch without FSDP_VERSION: accelerate's own default
    ("1", "true", 1),
    ("2", "true", 2),
    (" 2 ", None, 2),  # accelerate's plugin reads FSDP_VERSION even without `accelerate launch`
])
def test_fsdp_version_follows_accelerate(no_accelerate_env, env, use_fsdp, expected):
    if env is not None:
        no_accelerate_env.setenv("FSDP_VERSION", env)
    if use_fsdp is not None:
        no_accelerate_env.setenv("ACCELERATE_USE_FSDP", use_fsdp)
    assert resolve_fsdp_version() == expected


@pytest.mark.parametrize("value", [0, 3, "2", 2.0, True, "fully_shard"])
def test_bad_fsdp_version_names_argument_value_and_fix(no_accelerate_env, value):
    with pytest.raises(ValueError, match=r"`fsdp_version` must be 1 .* or 2 .*got") as info:
        resolve_fsdp_version(value)
    assert repr(value) in str(info.value) and "Pass the version" in str(info.value)


def test_bad_fsdp_version_env_names_the_variable(no_accelerate_env, tiny_llama_path):
    no_accelerate_env.setenv("FSDP_VERSION", "two")
    with pytest.raises(ValueError, match=r"`FSDP_VERSION` must be 1 or 2, got 'two'.*fsdp_version: 2"):
        resolve_fsdp_version()
    model = _peft_model(tiny_llama_path)
    with pytest.raises(ValueError, match="FSDP_VERSION"):
        prepare_for_fsdp(model, strict=False)  # a broken setting is not a model problem: raised even when non-strict
    with pytest.raises(ValueError, match="`fsdp_version` must be"):
        prepare_for_fsdp(model, fsdp_version=0)


# ---- FSDP2: packed weights as bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16, torch.float16, torch.float32])
def test_fsdp2_views_packed_weights_as_bytes(tiny_llama_path, caplog, storage):
    """Any storage: the same Params4bit objects over the same bytes, now uint8; outputs bit-identical; adapters keep
    the policy's dtype (fp32 here) and nothing is logged at WARNING."""
    model = _peft_model(tiny_llama_path, storage=storage)
    weights, before = _packed_weights(model), _packed_bytes(model)
    ptrs = [w.data_ptr() for w in weights]
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=2)
    assert _messages(caplog) == []
    assert _packed_weights(model) == weights and [w.data_ptr() for w in weights] == ptrs  # views, no copies
    assert all(type(w).__name__ == "Params4bit" and w.dtype == torch.uint8 and w.shape[1] == 1 for w in weights)
    assert all(w.quant_storage == torch.uint8 for w in weights)
    assert all(m.get_base_layer().quant_storage == torch.uint8 for m in model.modules()
               if isinstance(m, FastLoraLinear4bit))
    assert all(torch.equal(a, b) for a, b in zip(_packed_bytes(model), before))
    assert _trainable_dtypes(model) == {torch.float32}
    assert all(m.fsdp2_prepared for m in model.modules() if isinstance(m, FastLoraLinear4bit))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=2)  # idempotent
    assert _messages(caplog) == [] and all(w.dtype == torch.uint8 for w in _packed_weights(model))


def test_fsdp2_keeps_adapter_dtype_and_warns_about_mixed_trainable_dtypes(tiny_llama_path, caplog):
    """fp32 adapters and a bf16 modules_to_save copy stay as they are (a cast either way would break something);
    one line says that FSDP2 needs them in different units."""
    model = _peft_model(tiny_llama_path, modules_to_save=["lm_head"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=2)
    assert _trainable_dtypes(model) == {torch.float32, torch.bfloat16}
    messages = _messages(caplog)
    assert len(messages) == 1, messages
    assert "several dtypes" in messages[0] and "uniform original parameter dtype" in messages[0]
    assert "torch.float32" in messages[0] and "torch.bfloat16" in messages[0]


def test_fsdp2_leaves_mixed_precision_copies_alone(tiny_llama_path):
    """FSDP2 mixed precision hands the layer bf16 copies of fp32 adapters: no recast warning, no cast back (a cast
    back would detach the layer from FSDP2's unsharded parameters). Without FSDP2 the guard still restores."""
    for fsdp2 in (True, False):
        model = _peft_model(tiny_llama_path)
        if fsdp2:
            prepare_for_fsdp(model, fsdp_version=2)
        layer = _first_4bit_layer(model)
        for module in (layer.lora_A["default"], layer.lora_B["default"]):
            module.weight.data = module.weight.data.to(torch.bfloat16)  # what FSDP2's param_dtype all-gather gives
        x = torch.randn(2, 3, layer.in_features, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            layer(x)
        recast = [w for w in record if "outside peft_fastlora" in str(w.message)]
        assert bool(recast) is not fsdp2
        assert layer.lora_A["default"].weight.dtype == (torch.bfloat16 if fsdp2 else torch.float32)


def test_fsdp2_frozen_params_in_another_dtype_are_fine(tiny_llama_path):
    model = _peft_model(tiny_llama_path, dtype=torch.float32, storage=torch.bfloat16)
    prepare_for_fsdp(model, fsdp_version=2)
    assert all(w.dtype == torch.uint8 for w in _packed_weights(model))


@pytest.mark.parametrize("shards_bytes", [True, False])
def test_fsdp2_ignored_params_on_old_torch(tiny_llama_path, monkeypatch, caplog, shards_bytes):
    """torch < 2.12 cannot shard uint8 parameters: there the packed weights go to `ignored_params`, and one line says
    so; newer torch shards them."""
    monkeypatch.setattr(D, "FSDP2_SHARDS_BYTES", shards_bytes)
    model = _peft_model(tiny_llama_path, adapter_dtype="bf16")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=2)
    ignored = fsdp2_ignored_params(model)
    messages = [r.getMessage() for r in caplog.records]
    if shards_bytes:
        assert ignored == set() and messages == []
    else:
        assert {id(p) for p in ignored} == {id(w) for w in _packed_weights(model)} and len(ignored) == 14
        assert len(messages) == 1 and "ignored_params=peft_fastlora.distributed.fsdp2_ignored_params" in messages[0]


def test_fsdp2_unquantized_layer_fails_before_changing_anything(tiny_llama_path):
    """A 4-bit layer without quant_state (e.g. still on the meta device) would be re-viewed as garbage: refuse."""
    import bitsandbytes as bnb

    model = _peft_model(tiny_llama_path)
    before = _packed_bytes(model)
    model.base_model.model.model.raw = bnb.nn.Linear4bit(16, 8)  # never moved to a device, so never quantized
    with pytest.raises(FSDPConfigError, match=r"'.*raw' is not quantized .*`quant_state`"):
        prepare_for_fsdp(model, fsdp_version=2)
    assert all(torch.equal(a, b) for a, b in zip(_packed_bytes(model), before))
    assert all(w.dtype == torch.bfloat16 for w in _packed_weights(model))


# ---- FSDP1: float storage = model dtype, adapters cast ------------------------------------------------------------


def test_prepare_for_fsdp_raises_no_warning_for_either_version(tiny_llama_path):
    """Preparing a well-formed model warns about nothing, for either version."""
    for version in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            prepare_for_fsdp(_peft_model(tiny_llama_path), fsdp_version=version)


def test_fsdp1_uint8_storage_fails_before_training(tiny_llama_path):
    model = _peft_model(tiny_llama_path, storage=torch.uint8)
    with pytest.raises(FSDPConfigError, match=r"`bnb_4bit_quant_storage` is torch\.uint8") as info:
        prepare_for_fsdp(model, fsdp_version=1)
    assert "bnb_4bit_quant_storage=torch.bfloat16" in str(info.value) and "fsdp_version=2" in str(info.value)
    assert _trainable_dtypes(model) == {torch.float32}  # nothing changed
    assert all(w.dtype == torch.uint8 for w in _packed_weights(model))


def test_fsdp1_non_strict_logs_instead(tiny_llama_path, caplog):
    model = _peft_model(tiny_llama_path, storage=torch.uint8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, strict=False, fsdp_version=1)
    assert len(caplog.records) == 1 and "bnb_4bit_quant_storage" in caplog.records[0].getMessage()
    assert _trainable_dtypes(model) == {torch.float32}


def test_fsdp1_adapters_take_storage_dtype_with_one_log_line(tiny_llama_path, caplog):
    model = _peft_model(tiny_llama_path, modules_to_save=["lm_head"])
    assert _trainable_dtypes(model) == {torch.float32, torch.bfloat16}  # fp32 adapters, bf16 lm_head copy
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=1)
    assert _trainable_dtypes(model) == {torch.bfloat16}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "adapter_dtype='fp32'" in messages[0] and "torch.float32" in messages[0] and "torch.bfloat16" in messages[0]
    layer = _first_4bit_layer(model)
    assert set(layer.adapter_dtypes.values()) == {torch.bfloat16}
    assert not layer.fsdp2_prepared

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_for_fsdp(model, fsdp_version=1)  # idempotent: nothing left to cast, nothing logged
    assert caplog.records == []

    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    assert not [w for w in record if "outside peft_fastlora" in str(w.message)]  # no fight with the adapter policy
    assert _trainable_dtypes(model) == {torch.bfloat16}


def test_fsdp1_frozen_adapters_are_cast_too(tiny_llama_path):
    """An inference-mode adapter (frozen) is flattened with the 4-bit weights all the same."""
    model = _peft_model(tiny_llama_path, inference_mode=True)
    assert _trainable_dtypes(model) == set()
    prepare_for_fsdp(model, fsdp_version=1)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}


def test_fsdp1_frozen_params_in_another_dtype_fail(tiny_llama_path):
    model = _peft_model(tiny_llama_path, dtype=torch.float32, storage=torch.bfloat16)
    with pytest.raises(FSDPConfigError, match=r"Load the model with `dtype=torch\.bfloat16`"):
        prepare_for_fsdp(model, fsdp_version=1)


@pytest.mark.parametrize("version", [1, 2])
def test_8bit_layers_fail(tiny_llama_path, version):
    base = load_quantized(tiny_llama_path, torch.float16, bits=8)
    model = get_peft_model(base, peft_fastlora.FastLoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(FSDPConfigError, match="8-bit"):
        prepare_for_fsdp(model, fsdp_version=version)


def _fsdp_style_weight(base: nn.Module, dtype=None) -> None:
    """What FSDP leaves on the module during forward: a plain Parameter over the (all-gathered) packed bytes."""
    data = base.weight.data.clone()
    base.weight = nn.Parameter(data if dtype is None else data.to(dtype), requires_grad=False)


@pytest.mark.parametrize("version", [None, 2])
def test_quant_state_is_restored_after_fsdp_style_replacement(tiny_llama_path, version):
    """The layer itself puts bitsandbytes' quant_state back on FSDP's plain weight (no hook needed)."""
    model = _peft_model(tiny_llama_path)
    if version is not None:
        prepare_for_fsdp(model, fsdp_version=version)  # the all-gathered weight is then uint8
    layer = _first_4bit_layer(model)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16)
    expected = layer(x)
    _fsdp_style_weight(layer.get_base_layer())
    assert getattr(layer.get_base_layer().weight, "quant_state", None) is None
    assert layer.get_base_layer().weight.dtype == (torch.bfloat16 if version is None else torch.uint8)
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)


def test_restore_quant_state_rejects_cast_bytes(tiny_llama_path):
    model = _peft_model(tiny_llama_path)
    base = _first_4bit_layer(model).get_base_layer()
    _fsdp_style_weight(base, torch.float16)  # e.g. FSDP mixed precision param_dtype=fp16 over bf16 storage
    with pytest.raises(RuntimeError, match="bnb_4bit_quant_storage"):
        restore_quant_state(base)


@pytest.mark.parametrize("env_version", [None, "1", "2"])
def test_prepare_if_launched_follows_accelerate_env(tiny_llama_path, no_accelerate_env, env_version, caplog):
    model = _peft_model(tiny_llama_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        prepare_if_launched(model)
    assert caplog.records == []  # not launched: nothing done, nothing said
    assert _trainable_dtypes(model) == {torch.float32}
    assert all(w.dtype == torch.bfloat16 for w in _packed_weights(model))
    no_accelerate_env.setenv("ACCELERATE_USE_FSDP", "true")
    if env_version is not None:
        no_accelerate_env.setenv("FSDP_VERSION", env_version)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        prepare_if_launched(model)
    version = 2 if env_version == "2" else 1
    assert any(f"FSDP{version}" in r.getMessage() and "prepare_for_fsdp" in r.getMessage() for r in caplog.records)
    if env_version == "2":  # FSDP2: bytes, adapters keep the policy
        assert _trainable_dtypes(model) == {torch.float32}
        assert all(w.dtype == torch.uint8 for w in _packed_weights(model))
    else:  # FSDP1, accelerate's default: adapters take the storage dtype
        assert _trainable_dtypes(model) == {torch.bfloat16}
        assert all(w.dtype == torch.bfloat16 for w in _packed_weights(model))


def test_get_peft_model_prepares_under_an_fsdp_launch(tiny_llama_path, no_accelerate_env, caplog):
    """Under `accelerate launch` with FSDP the tuner runs the launch hook after adding the adapter, and logs it."""
    no_accelerate_env.setenv("ACCELERATE_USE_FSDP", "true")
    no_accelerate_env.setenv("FSDP_VERSION", "2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = _peft_model(tiny_llama_path)
    assert any("prepare_for_fsdp" in r.getMessage() for r in caplog.records)
    assert all(w.dtype == torch.uint8 for w in _packed_weights(model))
    assert all(m.fsdp2_prepared for m in model.modules() if isinstance(m, FastLoraLinear4bit))


def test_save_adapter_matches_save_pretrained(tiny_llama_path, tmp_path):
    from tests.distributed.fsdp_worker import compare_saved

    model = _peft_model(tiny_llama_path, modules_to_save=["lm_head"])
    save_adapter(model, tmp_path / "helper")
    model.save_pretrained(tmp_path / "plain")
    result = compare_saved(tmp_path / "helper", tmp_path / "plain")
    assert result["ok"] and result["values"]["exact"], result


def test_adapters_are_not_fsdp_units_without_fsdp(tiny_llama_path):
    model = _peft_model(tiny_llama_path)
    assert not _first_4bit_layer(model).adapters_are_fsdp_units(["default"])


def test_off_device_tensors_names_stray_buffers():
    """The DDP worker's preflight names a buffer left on another device (NCCL cannot broadcast a CPU tensor)."""
    import torch

    from tests.distributed import _common as C

    module = torch.nn.Linear(3, 2)
    assert C.off_device_tensors(module, torch.device("cpu")) == []
    module.register_buffer("counter", torch.zeros((), device="meta"))
    assert C.off_device_tensors(module, torch.device("cpu")) == ["counter (meta)"]
