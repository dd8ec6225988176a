"""The one module that touches PEFT internals, and the list of every one of them that peft_fastlora uses.

PEFT has no public API for adding a ``PeftType`` member, so this module extends the enum, registers the FASTLORA
method (config class, tuner class, the ``lora_`` key prefix) and hooks ``save_pretrained`` to add the FastLoRA
model card. Everything is idempotent on re-import and fails loudly, before anything is changed, on a PEFT whose
internals differ: [`check_peft_version`] runs once, when this module is imported, and checks every entry of
[`PRIVATE_PEFT_API`].

Other modules reach private PEFT symbols only through this module (the accessors below), or override a private PEFT
method under its own name; both kinds are listed in [`PRIVATE_PEFT_API`] (``tests/test_registry.py`` checks that no
module uses one that is not listed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import NamedTuple

import peft
from packaging.version import Version

from ._atomic import staged_write

# The oldest PEFT whose internals this module was written against; newer releases are accepted as long as every
# [`PRIVATE_PEFT_API`] entry and public entry point below still resolves (checked at import).
MIN_PEFT = Version("0.21.0")
FASTLORA = "FASTLORA"
_CARD_HOOK_MARK = "_peft_fastlora_card_hook"
_STATE_DICT_HOOK_MARK = "_peft_fastlora_state_dict_hook"


class PrivateSymbol(NamedTuple):
    """One PEFT internal that peft_fastlora relies on: ``module.owner`` (a dotted path), and how it is used."""

    module: str
    owner: str
    use: str


PRIVATE_PEFT_API = (
    PrivateSymbol("peft.utils.peft_types", "PeftType._member_map_", "extend_peft_type adds FASTLORA"),
    PrivateSymbol("peft.utils.peft_types", "PeftType._value2member_map_", "extend_peft_type adds FASTLORA"),
    PrivateSymbol("peft.utils.peft_types", "PeftType._member_names_", "extend_peft_type adds FASTLORA"),
    PrivateSymbol("peft.mapping", "PEFT_TYPE_TO_PREFIX_MAPPING", "register_method shares LoRA's prefix"),
    PrivateSymbol("peft.tuners.lora", "LoraModel._create_new_module", "FastLoraModel overrides it; create_lora_module"),
    PrivateSymbol("peft.tuners.lora", "LoraModel._cast_adapter_dtype", "FastLoraModel overrides it (dtype policy)"),
    PrivateSymbol("peft.tuners.lora", "LoraModel._get_adapter_state_dict", "hook_adapter_state_dict wraps it"),
    PrivateSymbol("peft.tuners.lora", "LoraLayer._move_adapter_to_device_of_base_layer", "FastLoraLayer overrides it"),
    PrivateSymbol("peft.tuners.lora", "LoraLayer._check_forward_args", "FastLoraLayer.forward (adapter_names=)"),
    PrivateSymbol("peft.tuners.tuners_utils", "BaseTunerLayer._active_adapter", "FastLoraLayer.__init__ sets it"),
    PrivateSymbol("peft.utils.other", "AuxiliaryTrainingWrapper", "auxiliary_training_wrapper (saving)"),
    PrivateSymbol("peft.utils.other", "ModulesToSaveWrapper", "modules_to_save_wrapper (FSDP1 saving)"),
    PrivateSymbol("peft.utils.save_and_load", "_validate_lora_adapter_state_dict", "validate_adapter_state_dict"),
    PrivateSymbol("peft.utils.hotswap", "CONFIG_KEYS_TO_CHECK", "enable_hotswap: hotswap_adapter accepts FASTLORA"),
)


class UnsupportedPeftVersionError(ImportError):
    """Raised when the installed PEFT does not have the internals this plugin extends."""


def _fail(what: str) -> None:
    raise UnsupportedPeftVersionError(
        f"peft_fastlora needs peft>={MIN_PEFT} with the internals it lists, but the installed peft {peft.__version__} "
        f'{what}. Install a version known to work: pip install "peft>={MIN_PEFT},<0.22" (see docs/versions.md).'
    )


def _resolve(symbol: PrivateSymbol):
    """The object ``symbol`` names; raises `AttributeError` / `ImportError` when PEFT does not have it."""
    obj = importlib.import_module(symbol.module)
    for part in symbol.owner.split("."):
        obj = getattr(obj, part)
    return obj


def check_peft_version() -> None:
    """Checks the installed PEFT version, its public entry points used here, and every [`PRIVATE_PEFT_API`] entry."""
    if Version(Version(peft.__version__).base_version) < MIN_PEFT:
        _fail("is older")
    from peft import mapping, peft_model, utils

    for owner, name in [
        (utils, "register_peft_method"),
        (mapping, "PEFT_TYPE_TO_CONFIG_MAPPING"),
        (mapping, "PEFT_TYPE_TO_TUNER_MAPPING"),
        (peft_model.PeftModel, "save_pretrained"),
    ]:
        if not hasattr(owner, name):
            _fail(f"has no `{getattr(owner, '__name__', owner)}.{name}`")
    for symbol in PRIVATE_PEFT_API:
        try:
            _resolve(symbol)
        except (AttributeError, ImportError):
            _fail(f"has no `{symbol.module}.{symbol.owner}` (used: {symbol.use})")


# ---- accessors: how the rest of the package reaches the listed internals ---------------------------------------------
def create_lora_module(lora_config, adapter_name: str, target, **kwargs):
    """PEFT's own choice of LoRA layer for ``target`` (``LoraModel._create_new_module``)."""
    from peft.tuners.lora import LoraModel

    return LoraModel._create_new_module(lora_config, adapter_name, target, **kwargs)


def auxiliary_training_wrapper() -> type:
    """PEFT's base class of ``modules_to_save`` / trainable-token wrappers."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    return AuxiliaryTrainingWrapper


def modules_to_save_wrapper() -> type:
    """PEFT's ``modules_to_save`` wrapper class."""
    from peft.utils.other import ModulesToSaveWrapper

    return ModulesToSaveWrapper


def validate_adapter_state_dict(state_dict: dict, adapter_name: str) -> None:
    """PEFT's check for LoRA tensors saved un-gathered (ZeRO-3 / FSDP shards): warns on 1-D or empty ``lora_A/B``.

    PEFT runs it only for LORA and ADALORA; FASTLORA adapters are LoRA tensors, so the tuner runs it too.
    """
    from peft.utils.save_and_load import _validate_lora_adapter_state_dict

    _validate_lora_adapter_state_dict(state_dict, adapter_name=adapter_name)


def enable_hotswap(peft_type) -> None:
    """Lets ``peft.utils.hotswap`` swap FASTLORA adapters: it checks the same config keys as for LoRA (FastLoRA
    adapters are LoRA tensors in LoRA modules)."""
    from peft.utils.hotswap import CONFIG_KEYS_TO_CHECK
    from peft.utils.peft_types import PeftType

    CONFIG_KEYS_TO_CHECK[peft_type] = list(CONFIG_KEYS_TO_CHECK[PeftType.LORA])


def extend_peft_type():
    """Adds ``PeftType.FASTLORA`` (a ``str`` enum member equal to ``"FASTLORA"``); returns the member."""
    from peft.utils.peft_types import PeftType

    if FASTLORA in PeftType._member_map_:
        return PeftType._member_map_[FASTLORA]
    member = str.__new__(PeftType, FASTLORA)
    member._name_ = FASTLORA
    member._value_ = FASTLORA
    member.__objclass__ = PeftType
    member.__init__(FASTLORA)
    # Set the class attribute before the member maps: EnumType.__setattr__ refuses names that are already members.
    type.__setattr__(PeftType, FASTLORA, member)
    PeftType._member_map_[FASTLORA] = member
    PeftType._value2member_map_[FASTLORA] = member
    PeftType._member_names_.append(FASTLORA)
    return member


def register_method(config_cls, model_cls) -> None:
    """Registers FASTLORA with ``peft.utils.register_peft_method``, sharing LoRA's ``lora_`` key prefix.

    ``register_peft_method`` refuses a prefix that another method already uses, and LoRA owns ``lora_``; FastLoRA
    adapters must keep LoRA's keys (so plain PEFT, vLLM and friends can read them), so LoRA's entry is lifted for
    the duration of the call and put back. Re-registration (a re-import) just refreshes the classes.
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method
    from peft.utils.peft_types import PeftType

    peft_type = extend_peft_type()
    enable_hotswap(peft_type)
    if peft_type in PEFT_TYPE_TO_TUNER_MAPPING:
        PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
        return
    lora_prefix = PEFT_TYPE_TO_PREFIX_MAPPING.pop(PeftType.LORA)
    try:
        register_peft_method(name=FASTLORA.lower(), config_cls=config_cls, model_cls=model_cls, prefix=lora_prefix)
    finally:
        PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.LORA] = lora_prefix


class _CleanNamesView:
    """``model`` as PEFT's adapter-key selection should see it: ``named_modules`` yields names without wrapper
    segments (``clean_name``), i.e. the names its full state dict uses; every other attribute is the model's."""

    def __init__(self, model, clean_name):
        self._model = model
        self._clean_name = clean_name

    def named_modules(self, *args, **kwargs):
        for name, module in self._model.named_modules(*args, **kwargs):
            yield self._clean_name(name), module

    def __getattr__(self, name):
        return getattr(self._model, name)


def hook_adapter_state_dict(model_cls, clean_name) -> None:
    """Makes ``model_cls._get_adapter_state_dict`` (PEFT's selection of the adapter's entries of a state dict) match
    module names without FSDP1 / checkpoint-wrapper segments (``clean_name``).

    PEFT 0.21 selects the adapter keys by the names of the tuner layers' modules and strips ``_fsdp_wrapped_module.``
    only at the start of a name. Under FSDP1 with nested units (the HF Trainer wraps every decoder layer, and PEFT's
    ``fsdp_auto_wrap_policy`` every ``lora_A`` / ``lora_B``) a layer is named ``...layers.0._fsdp_wrapped_module.
    self_attn.q_proj`` while the FULL_STATE_DICT keys are ``...layers.0.self_attn.q_proj.lora_A.default.weight``:
    without the clean names nothing would match, and ``Trainer.save_model`` would write only the ``modules_to_save``
    tensors. A no-op without such names. The selection then goes through PEFT's check for un-gathered ZeRO-3 / FSDP
    tensors, which PEFT itself runs only for LORA and ADALORA.
    """
    original = model_cls._get_adapter_state_dict  # bound to model_cls: calls LoRA's (and PEFT's base) selection
    original = getattr(original, _STATE_DICT_HOOK_MARK, original)

    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        if any(clean_name(name) != name for name, _ in model.named_modules()):
            model = _CleanNamesView(model, clean_name)
        selected = original(model, config, adapter_name, state_dict, unwanted_adapter_names)
        validate_adapter_state_dict(selected, adapter_name)  # PEFT runs it for LORA and ADALORA only
        return selected

    _get_adapter_state_dict.__doc__ = original.__doc__
    hooked = classmethod(_get_adapter_state_dict)
    setattr(_get_adapter_state_dict, _STATE_DICT_HOOK_MARK, original)
    model_cls._get_adapter_state_dict = hooked


def _is_fastlora(peft_model) -> bool:
    configs = getattr(peft_model, "peft_config", None) or {}
    return any(getattr(c, "peft_type", None) == PEFT_TYPE_FASTLORA for c in configs.values())


def hook_model_card(update_card, saving_context=None) -> None:
    """Makes ``PeftModel.save_pretrained`` call ``update_card(peft_model, save_directory, adapter_names=...)``.

    It runs after PEFT has written its own card and the adapter files, on the main process only, with the adapters
    that were actually saved (``selected_adapters``, default: all). For FastLoRA models given a ``state_dict`` (the
    HF Trainer passes one under FSDP), PEFT's save runs inside ``saving_context(peft_model, state_dict)``.
    """
    from peft.peft_model import PeftModel

    original = PeftModel.save_pretrained
    original = getattr(original, _CARD_HOOK_MARK, original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        context = contextlib.nullcontext()
        if kwargs.get("state_dict") is not None and _is_fastlora(self) and saving_context is not None:
            context = saving_context(self, kwargs["state_dict"])
        bound = inspect.signature(original).bind(self, save_directory, *args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments.get("is_main_process", True):
            with context:
                return original(self, save_directory, *args, **kwargs)
        # Written beside save_directory, then moved into it: a failed save leaves the previous files as they were.
        with context, staged_write(save_directory, keep=("README.md",)) as staging:
            original(self, staging, *args, **kwargs)
            selected = bound.arguments.get("selected_adapters") or list(self.peft_config)
            update_card(self, staging, adapter_names=list(selected))

    setattr(save_pretrained, _CARD_HOOK_MARK, original)
    PeftModel.save_pretrained = save_pretrained


check_peft_version()
PEFT_TYPE_FASTLORA = extend_peft_type()
