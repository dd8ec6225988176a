import importlib
import subprocess
import sys

import pytest
from peft import PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils.peft_types import PeftType

import peft_fastlora
from peft_fastlora import _registry


def test_fastlora_is_a_peft_type():
    assert PeftType.FASTLORA == "FASTLORA"
    assert PeftType("FASTLORA") is PeftType.FASTLORA
    assert PeftType["FASTLORA"] is PeftType.FASTLORA
    assert PeftType.FASTLORA in list(PeftType)


def test_registered_with_lora_prefix_and_classes():
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.FASTLORA] is peft_fastlora.FastLoraConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.FASTLORA] is peft_fastlora.FastLoraModel
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.FASTLORA] == "lora_"
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.LORA] == "lora_", "LoRA's own prefix must be left in place"


def test_registration_is_idempotent_on_reimport():
    members_before = list(PeftType)
    importlib.reload(_registry)
    reloaded = importlib.reload(peft_fastlora)
    assert list(PeftType) == members_before
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.FASTLORA] is reloaded.FastLoraConfig
    assert isinstance(reloaded.FastLoraConfig(r=4), PeftConfig)


def test_unsupported_peft_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(_registry.peft, "__version__", "0.19.0")
    with pytest.raises(_registry.UnsupportedPeftVersionError, match=r"peft>=0\.21\.0,<0\.22\.0.*0\.19\.0"):
        _registry.check_peft_version()


def test_missing_internal_fails_loudly(monkeypatch):
    from peft import mapping

    monkeypatch.delattr(mapping, "PEFT_TYPE_TO_PREFIX_MAPPING")
    with pytest.raises(_registry.UnsupportedPeftVersionError, match="PEFT_TYPE_TO_PREFIX_MAPPING"):
        _registry.check_peft_version()


def test_import_does_not_initialise_cuda():
    code = "import torch, peft_fastlora; assert not torch.cuda.is_initialized(); print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
