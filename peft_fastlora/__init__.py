"""peft-fastlora: fast, dtype-safe QLoRA for Hugging Face PEFT.

Importing the package registers ``PeftType.FASTLORA`` with PEFT, so ``get_peft_model(model, FastLoraConfig(...))``,
``PeftModel.from_pretrained`` and ``AutoPeftModel*`` work with FastLoRA adapters.
"""

from . import _registry
from .config import FastLoraConfig
from .dtypes import ADAPTER_DTYPE_POLICIES, resolve_adapter_dtype
from .guard import overflow_report
from .layer import FastLoraLayer
from .model import FastLoraModel

_registry.check_peft_version()
_registry.register_method(FastLoraConfig, FastLoraModel)

__version__ = "0.1.0"
__all__ = [
    "ADAPTER_DTYPE_POLICIES",
    "FastLoraConfig",
    "FastLoraLayer",
    "FastLoraModel",
    "overflow_report",
    "resolve_adapter_dtype",
]
