"""``FastLoraModel``: PEFT's ``LoraModel`` with FastLoRA layers on quantized targets and the adapter dtype policy."""

from __future__ import annotations

from typing import Optional

from peft.tuners.lora import LoraModel
from torch import nn

from .bnb import DISPATCHERS
from .distributed import maybe_prepare_for_fsdp
from .dtypes import apply_adapter_dtype_policy
from .layer import FastLoraLayer
from .trainer_check import register_fp16_autocast_check


class FastLoraModel(LoraModel):
    """The tuner behind ``PeftType.FASTLORA``; created by ``get_peft_model`` with a [`FastLoraConfig`].

    bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` targets become FastLoRA layers; every other target gets PEFT's
    standard LoRA layer. Adapter keys, files and APIs are LoRA's.
    """

    prefix: str = "lora_"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # fp16 training with adapters GradScaler cannot unscale fails here with a message naming `adapter_dtype`,
        # not deep inside GradScaler (the hook removes itself after the first training forward).
        register_fp16_autocast_check(self)

    @staticmethod
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        for dispatch in DISPATCHERS:
            new_module = dispatch(target, adapter_name, config=lora_config, **kwargs)
            if new_module is not None:
                return new_module
        return LoraModel._create_new_module(lora_config, adapter_name, target, **kwargs)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # The adapter_dtype policy replaces PEFT's autocast_adapter_dtype upcast, whatever its value.
        apply_adapter_dtype_policy(self.model, adapter_name, self.peft_config[adapter_name].adapter_dtype)
        maybe_prepare_for_fsdp(self)  # under an FSDP launch: one dtype for adapters and quant storage (logged)

    def merge_and_unload(
        self,
        progressbar: bool = False,
        safe_merge: bool = False,
        adapter_names: Optional[list[str]] = None,
        dequantize: bool = False,
    ) -> nn.Module:
        """Merges the adapters into the base model and returns it without PEFT wrappers.

        Args:
            progressbar (`bool`): Show a progress bar.
            safe_merge (`bool`): Check merged weights for NaN/inf.
            adapter_names (`list[str]`, *optional*): Adapters to merge (default: the active ones).
            dequantize (`bool`, defaults to `False`):
                ``False`` merges like PEFT: the quantized weights are requantized, which loses most of a small
                trained delta (a warning says so). ``True`` replaces every FastLoRA layer with an ``nn.Linear`` in its
                compute dtype holding ``dequant(W) + delta`` — lossless, at the memory cost of an unquantized layer.
        """
        if dequantize:
            self._dequantize_fastlora_layers(adapter_names, safe_merge)
        model = super().merge_and_unload(progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names)
        if dequantize:
            _forget_quantization_if_none_left(model)
        return model

    def _dequantize_fastlora_layers(self, adapter_names: Optional[list[str]], safe_merge: bool) -> None:
        layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, FastLoraLayer)]
        for name, layer in layers:
            linear = layer.dequantize_and_merge(adapter_names)
            if safe_merge and not linear.weight.isfinite().all():
                raise ValueError(f"NaNs detected in the merged weight of {name!r}: an adapter seems to be broken.")
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child, linear)


def _forget_quantization_if_none_left(model: nn.Module) -> None:
    """Drops transformers' quantization markers once no bitsandbytes layer is left, so the model saves and reloads
    as a plain one (otherwise ``from_pretrained`` would try to load bitsandbytes state that is not there)."""
    import bitsandbytes as bnb

    if any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules()):
        return
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr, value in (("hf_quantizer", None), ("is_quantized", False), ("is_loaded_in_4bit", False),
                        ("is_loaded_in_8bit", False)):
        if hasattr(model, attr):
            setattr(model, attr, value)
