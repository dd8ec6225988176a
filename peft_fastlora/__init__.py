"""peft-fastlora: fast, dtype-safe QLoRA for Hugging Face PEFT.

Importing the package registers ``PeftType.FASTLORA`` with PEFT, so ``get_peft_model(model, FastLoraConfig(...))``,
``PeftModel.from_pretrained`` and ``AutoPeftModel*`` work with FastLoRA adapters.
"""

from importlib import metadata as _metadata

from . import _registry
from .config import FastLoraConfig
from .distributed import clean_wrapper_keys, clean_wrapper_name, fsdp1_module_state_from, prepare_for_fsdp
from .dtypes import ADAPTER_DTYPE_POLICIES, resolve_adapter_dtype
from .export import export_lora, load_lora_as_fastlora
from .guard import overflow_report
from .layer import FastLoraLayer
from .model import FastLoraModel
from .model_card import update_model_card
from .trainer_check import FastLoraFp16Callback

_registry.check_peft_version()
_registry.register_method(FastLoraConfig, FastLoraModel)
_registry.hook_adapter_state_dict(FastLoraModel, clean_wrapper_name)
_registry.hook_model_card(
    update_model_card, clean_state_dict=clean_wrapper_keys, saving_context=fsdp1_module_state_from
)

try:  # the installed distribution's version; a source tree on sys.path without an install has none
    __version__: str = _metadata.version("peft-fastlora")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"
__all__ = [
    "ADAPTER_DTYPE_POLICIES",
    "FastLoraConfig",
    "FastLoraFp16Callback",
    "FastLoraLayer",
    "FastLoraModel",
    "export_lora",
    "load_lora_as_fastlora",
    "overflow_report",
    "prepare_for_fsdp",
    "resolve_adapter_dtype",
]
