"""peft-fastlora: fast, dtype-safe QLoRA for Hugging Face PEFT.

Importing the package registers ``PeftType.FASTLORA`` with PEFT, so ``get_peft_model(model, FastLoraConfig(...))``,
``PeftModel.from_pretrained`` and ``AutoPeftModel*`` work with FastLoRA adapters.
"""

from . import cli as _cli  # noqa: F401  (first: answers `--help` / `--version` of the CLI before torch is imported)

# isort: split
from importlib import metadata as _metadata

from . import _registry
from .config import FastLoraConfig
from .distributed import clean_wrapper_name, fsdp1_module_state_from, prepare_for_fsdp, prepare_if_launched
from .dtypes import ADAPTER_DTYPE_POLICIES, resolve_adapter_dtype
from .export import export_lora, load_lora_as_fastlora
from .fast_path import FastPathReport, enable_fast_path
from .generation import compile_for_generation, restore_eager_generation
from .graphed_decode import graphed_generate
from .graphed_step import GraphedTrainStep
from .graphed_trainer import RecordedSteps, record_trainer_steps
from .guard import overflow_report
from .layer import FastLoraLayer
from .model import FastLoraModel
from .model_card import update_model_card
from .trainer_check import FastLoraFp16Callback

# The wiring, in one place (_registry checked the PEFT version when it was imported above).
_registry.register_method(FastLoraConfig, FastLoraModel)
_registry.hook_adapter_state_dict(FastLoraModel, clean_wrapper_name)
_registry.hook_model_card(update_model_card, saving_context=fsdp1_module_state_from)
FastLoraModel.launch_hook = staticmethod(prepare_if_launched)  # FSDP preparation under `accelerate launch` (logged)

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
    "FastPathReport",
    "GraphedTrainStep",
    "RecordedSteps",
    "compile_for_generation",
    "enable_fast_path",
    "export_lora",
    "graphed_generate",
    "load_lora_as_fastlora",
    "overflow_report",
    "prepare_for_fsdp",
    "record_trainer_steps",
    "resolve_adapter_dtype",
    "restore_eager_generation",
]
