"""``FastLoraModel``: PEFT's ``LoraModel`` with FastLoRA layers on quantized targets and the adapter dtype policy."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Optional

from peft.tuners.lora import LoraLayer, LoraModel
from torch import nn

from . import _registry
from .bnb import DISPATCHERS, is_quantized_4bit, is_quantized_8bit
from .dtypes import apply_adapter_dtype_policy, float_cast_target
from .layer import FastLoraLayer, RecastNotice
from .model_card import read_facts
from .trainer_check import register_fp16_autocast_check

logger = logging.getLogger(__name__)

NO_QUANTIZED_TARGET_WARNING = (
    "FastLoraConfig of adapter {adapter!r} made no FastLoRA layer: none of its targets is a bitsandbytes 4-bit or "
    "8-bit layer ({plain} plain LoRA layers). The adapter is plain LoRA, saved with `peft_type: FASTLORA`. Load the "
    "base model with `BitsAndBytesConfig(load_in_4bit=True)` (or `load_in_8bit=True`) and target its linear layers "
    "(e.g. `target_modules='all-linear'`), or use `peft.LoraConfig` for an unquantized model."
)
QUANTIZATION_MISMATCH_WARNING = (
    "Adapter {adapter!r} was trained on a {trained}-bit base model (its model card says so), but this base model is "
    "{now}. The adapter learned to correct the {trained}-bit weights; on other weights its outputs differ. Load the "
    "base with {fix}."
)


class FastLoraModel(LoraModel):
    """The tuner behind ``PeftType.FASTLORA``; created by ``get_peft_model`` with a [`FastLoraConfig`].

    bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` targets become FastLoRA layers; every other target gets PEFT's
    standard LoRA layer. Adapter keys, files and APIs are LoRA's.

    After an adapter is added (``get_peft_model``, ``add_adapter``, ``load_adapter``, ``PeftModel.from_pretrained``) the
    tuner applies the ``adapter_dtype`` policy, warns when no quantized layer was converted or when the adapter's card
    says it was trained on another quantization, logs one INFO line saying what it built, and calls
    [`launch_hook`].
    """

    prefix: str = "lora_"
    # Called with the tuner after each adapter is added. `peft_fastlora/__init__.py` installs
    # `peft_fastlora.distributed.prepare_if_launched` here: under `accelerate launch` with an FSDP config it runs
    # `prepare_for_fsdp` (logged), before the HF Trainer wraps the model. The tuner does not import `distributed`,
    # which sits above it.
    launch_hook: ClassVar[Optional[Callable[[nn.Module], object]]] = None

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
        return _registry.create_lora_module(lora_config, adapter_name, target, **kwargs)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # PEFT's last step after adding an adapter. The adapter_dtype policy replaces PEFT's autocast_adapter_dtype
        # upcast, whatever its value.
        config = self.peft_config[adapter_name]
        apply_adapter_dtype_policy(self.model, adapter_name, config.adapter_dtype)
        notice = self.__dict__.setdefault("_recast_notice", RecastNotice())  # one recast warning per model
        for module in self.model.modules():
            if isinstance(module, FastLoraLayer):
                module.recast_notice = notice
        self._report_adapter(adapter_name)
        self._check_training_quantization(adapter_name, getattr(config, "loaded_from", None))
        if self.launch_hook is not None:
            self.launch_hook(self)

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        dtype = float_cast_target(fn)
        if dtype is not None:  # model.half() / .float() / .to(dtype): the activations now have that dtype
            for name, config in self.peft_config.items():
                apply_adapter_dtype_policy(self.model, name, config.adapter_dtype, compute_dtype=dtype)
        return result

    def add_weighted_adapter(self, adapters: list[str], weights: list[float], adapter_name: str, *args, **kwargs):
        """PEFT's ``add_weighted_adapter``; the new adapter then follows its ``adapter_dtype`` policy (PEFT builds it in
        fp32 whatever the policy says)."""
        super().add_weighted_adapter(adapters, weights, adapter_name, *args, **kwargs)
        apply_adapter_dtype_policy(self.model, adapter_name, self.peft_config[adapter_name].adapter_dtype)

    # ---- what was built ----------------------------------------------------------------------------------------------
    def _report_adapter(self, adapter_name: str) -> None:
        """One INFO line on what the adapter became; a warning when no quantized layer became a FastLoRA layer."""
        fast = {4: 0, 8: 0}
        plain = 0
        dtypes, devices = set(), set()
        for module in self.model.modules():
            if not isinstance(module, LoraLayer) or adapter_name not in module.lora_A:
                continue
            if isinstance(module, FastLoraLayer):
                fast[module.bits] += 1
                dtypes.add(str(module.lora_A[adapter_name].weight.dtype).removeprefix("torch."))
                devices.add(module.get_base_layer().weight.device.type)
            else:
                plain += 1
        if not fast[4] + fast[8]:
            warnings.warn(NO_QUANTIZED_TARGET_WARNING.format(adapter=adapter_name, plain=plain), stacklevel=4)
            return
        kernels = "Triton kernels (CUDA)" if devices == {"cuda"} else (
            "the pure-torch reference (CPU; Triton runs on CUDA)" if "cuda" not in devices
            else "Triton kernels on CUDA layers, the pure-torch reference elsewhere"
        )
        facts = (adapter_name, fast[4] + fast[8], fast[4], fast[8], plain, "/".join(sorted(dtypes)),
                 self.peft_config[adapter_name].adapter_dtype, kernels)  # fmt: skip
        # PEFT casts an adapter when it is made and again when `load_adapter` has filled it (`from_pretrained` does
        # both): the same facts are said once; a change (another dtype after loading) is said again
        reported = self.__dict__.setdefault("_adapter_reports", {})
        if reported.get(adapter_name) == facts:
            return
        reported[adapter_name] = facts
        logger.info(
            "peft_fastlora: adapter %r: %d FastLoRA layers (%d 4-bit, %d 8-bit), %d plain LoRA layers; adapter dtype "
            "%s (adapter_dtype=%r); kernels: %s.",
            *facts,
        )

    def _check_training_quantization(self, adapter_name: str, folder: Optional[Path]) -> None:
        """Warns when the adapter's model card (next to a local adapter) says it was trained on a base model with
        another bitsandbytes bit width than this one."""
        trained = _card_bits(folder) if folder is not None else None
        if trained is None:
            return
        now = 4 if any(map(is_quantized_4bit, self.model.modules())) else (
            8 if any(map(is_quantized_8bit, self.model.modules())) else None
        )
        if now == trained:
            return
        fix = f"`BitsAndBytesConfig(load_in_{trained}bit=True)`"
        if trained == 4:
            quant = (_card_facts(folder) or {}).get("quantization") or {}
            fix = f"`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={quant.get('quant_type', 'nf4')!r})`"
        warnings.warn(
            QUANTIZATION_MISMATCH_WARNING.format(
                adapter=adapter_name, trained=trained, now=f"{now}-bit" if now else "not quantized", fix=fix
            ),
            stacklevel=4,
        )

    # ---- merging -----------------------------------------------------------------------------------------------------
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
            adapter_names (`list[str]`, *optional*): Adapters to merge (default: the active ones). Layers an adapter
                does not target are left as they are.
            dequantize (`bool`, defaults to `False`):
                ``False`` merges like PEFT: the quantized weights are requantized, which loses most of a small
                trained delta (a warning says so). ``True`` replaces every FastLoRA layer with an ``nn.Linear`` in its
                compute dtype holding ``dequant(W) + delta`` — lossless, at the memory cost of an unquantized layer.
                Quantized layers that no adapter targeted stay quantized; the model's ``quantization_config`` then
                lists the dequantized layers in ``llm_int8_skip_modules``, so the saved checkpoint reloads with
                ``from_pretrained`` as it is in memory.
        """
        dequantized = self._dequantize_fastlora_layers(adapter_names, safe_merge) if dequantize else []
        model = super().merge_and_unload(progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names)
        if dequantize:
            _record_dequantized_layers(model, dequantized)
        return model

    def _dequantize_fastlora_layers(self, adapter_names: Optional[list[str]], safe_merge: bool) -> list[str]:
        layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, FastLoraLayer)]
        for name, layer in layers:
            linear = layer.dequantize_and_merge(adapter_names)
            if safe_merge and not linear.weight.isfinite().all():
                raise ValueError(f"NaNs detected in the merged weight of {name!r}: an adapter seems to be broken.")
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child, linear)
        return [name for name, _ in layers]


def _card_facts(folder: Path) -> Optional[dict]:
    for readme in (folder / "README.md", folder.parent / "README.md"):  # an adapter in a subfolder: the root's card
        if readme.is_file():
            try:
                return read_facts(readme.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                return None
    return None


def _card_bits(folder: Path) -> Optional[int]:
    """The bitsandbytes bit width the card next to ``folder`` records for the base model the adapter was trained on."""
    facts = _card_facts(folder)
    quant = facts.get("quantization") if isinstance(facts, dict) else None
    if not isinstance(quant, dict) or quant.get("method") != "bitsandbytes":
        return None
    bits = quant.get("bits")
    return bits if bits in (4, 8) else None


def _record_dequantized_layers(model: nn.Module, names: list[str]) -> None:
    """Makes the model's quantization markers match its layers after a dequantizing merge.

    No bitsandbytes layer left: the markers go, so the model saves and reloads as a plain one. Some left (layers no
    adapter targeted): the dequantized layers join ``llm_int8_skip_modules``, which transformers' bitsandbytes loader
    leaves unquantized, so the checkpoint holds both kinds consistently.
    """
    config = getattr(model, "config", None)
    quant = getattr(config, "quantization_config", None)
    if not any(is_quantized_4bit(m) or is_quantized_8bit(m) for m in model.modules()):
        if config is not None and hasattr(config, "quantization_config"):
            del config.quantization_config
        for attr, value in (("hf_quantizer", None), ("is_quantized", False), ("is_loaded_in_4bit", False),
                            ("is_loaded_in_8bit", False)):
            if hasattr(model, attr):
                setattr(model, attr, value)
        return
    if quant is None or not names:
        return
    skip = quant.get("llm_int8_skip_modules") if isinstance(quant, dict) else quant.llm_int8_skip_modules
    quantizer = getattr(model, "hf_quantizer", None)
    if skip is None:  # transformers then skips what it chose at load time (e.g. lm_head): keep those skipped
        skip = list(getattr(quantizer, "modules_to_not_convert", None) or [])
    merged = list(dict.fromkeys(list(skip) + names))
    if isinstance(quant, dict):
        quant["llm_int8_skip_modules"] = merged
    else:
        quant.llm_int8_skip_modules = merged
    if quantizer is not None and isinstance(getattr(quantizer, "modules_to_not_convert", None), list):
        quantizer.modules_to_not_convert = list(dict.fromkeys(quantizer.modules_to_not_convert + names))
