import json

import pytest
from peft import LoraConfig, PeftConfig
from peft.utils.peft_types import PeftType

from peft_fastlora import FastLoraConfig


def test_defaults_and_peft_type():
    config = FastLoraConfig(r=16, target_modules="all-linear")
    assert isinstance(config, LoraConfig)
    assert config.peft_type == PeftType.FASTLORA
    assert config.adapter_dtype == "fp32-if-fp16"
    assert config.fp16_overflow_guard is False


@pytest.mark.parametrize("policy", ["bf16", "fp32-if-fp16", "fp32"])
def test_round_trips_through_adapter_config_json(tmp_path, policy):
    FastLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], adapter_dtype=policy).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "FASTLORA"
    assert saved["adapter_dtype"] == policy
    loaded = PeftConfig.from_pretrained(tmp_path)
    assert type(loaded) is FastLoraConfig
    assert (loaded.r, loaded.lora_alpha, loaded.adapter_dtype) == (8, 16, policy)
    assert loaded.peft_type == PeftType.FASTLORA


@pytest.mark.parametrize("bad", ["fp16", "float32", "BF16", None, 16])
def test_bad_adapter_dtype_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"`adapter_dtype` must be one of 'bf16', 'fp32-if-fp16', 'fp32', got"):
        FastLoraConfig(adapter_dtype=bad)


def test_bad_overflow_guard_is_a_clear_error():
    with pytest.raises(ValueError, match="`fp16_overflow_guard` must be True or False, got 'yes'"):
        FastLoraConfig(fp16_overflow_guard="yes")


@pytest.mark.parametrize(
    "kwargs, what",
    [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "LoRA bias"), ({"use_qalora": True}, "QA-LoRA")],
)
def test_unsupported_lora_variants_are_rejected(kwargs, what):
    with pytest.raises(ValueError, match=f"does not support {what}.*peft.LoraConfig"):
        FastLoraConfig(**kwargs)


@pytest.mark.parametrize("init", ["pissa", "olora", "corda"])
def test_data_driven_inits_are_rejected(init):
    with pytest.raises(ValueError, match=f"`init_lora_weights` in .*got {init!r}"):
        FastLoraConfig(init_lora_weights=init)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_plain_inits_are_accepted(init):
    assert FastLoraConfig(init_lora_weights=init).init_lora_weights == init


@pytest.mark.parametrize("kwargs, what", [
    (dict(init_lora_weights="loftq", loftq_config={"loftq_bits": 4}), "init_lora_weights"),
    (dict(init_lora_weights="loftq"), "init_lora_weights"),  # LoraConfig alone would ask for a loftq_config
    (dict(use_bdlora=True), "BD-LoRA"),  # LoraConfig alone raises a TypeError about the sub-config type
])
def test_unsupported_lora_features_fail_with_our_error_first(kwargs, what):
    with pytest.raises(ValueError, match=rf"FastLoraConfig (does not support|supports).*{what}") as info:
        FastLoraConfig(r=4, target_modules=["q_proj"], **kwargs)
    assert "peft.LoraConfig" in str(info.value)
