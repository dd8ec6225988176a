"""``FastLoraConfig``: a ``LoraConfig`` with an explicit adapter dtype policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from peft import LoraConfig

from ._registry import PEFT_TYPE_FASTLORA
from .dtypes import DEFAULT_ADAPTER_DTYPE, check_adapter_dtype

# LoRA variants whose math the FastLoRA kernels do not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "alora_invocation_tokens": "aLoRA",
    "arrow_config": "Arrow",
    "lora_bias": "LoRA bias (`lora_bias=True`)",
    "use_qalora": "QA-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "use_bdlora": "BD-LoRA",
}
# Initialisations that read or rewrite the base weight (which is quantized here) are not supported.
_SUPPORTED_INITS = (True, False, "gaussian", "orthogonal")


@dataclass
class FastLoraConfig(LoraConfig):
    """Configuration of a FastLoRA adapter: every [`~peft.LoraConfig`] field, plus:

    Args:
        adapter_dtype (`str`, defaults to `"fp32-if-fp16"`):
            Dtype policy for the adapter parameters, resolved per layer from its compute dtype (the
            ``bnb_4bit_compute_dtype`` of a 4-bit layer; the model dtype for an 8-bit layer):
            ``"bf16"`` always bf16 (the QLoRA paper); ``"fp32-if-fp16"`` fp32 when the compute dtype is fp16 (so
            torch's GradScaler can unscale the gradients), bf16 when it is bf16, fp32 when it is fp32; ``"fp32"``
            always fp32. PEFT's ``autocast_adapter_dtype`` does not override it, and a forward pass restores it (with
            a one-time warning) if something outside, such as a trainer, cast the adapters.
        fp16_overflow_guard (`bool`, defaults to `False`):
            Clamp non-finite or overflowing fp16 inputs and outputs of every FastLoRA layer to the fp16 finite range
            and count how often that happened (see `peft_fastlora.overflow_report`). For fp16 models whose
            activations exceed 65504 (e.g. Gemma-style MLPs); it costs nothing when off.
    """

    adapter_dtype: str = field(
        default=DEFAULT_ADAPTER_DTYPE,
        metadata={"help": "Adapter dtype policy: 'bf16', 'fp32-if-fp16' (default) or 'fp32'."},
    )
    fp16_overflow_guard: bool = field(
        default=False,
        metadata={"help": "Clamp overflowing fp16 inputs/outputs of FastLoRA layers to the finite fp16 range."},
    )

    def __post_init__(self):
        # Our checks come first: LoraConfig's own would reject some of these settings (`loftq`, `use_bdlora=True`)
        # with an error that does not say FastLoRA cannot use them.
        check_adapter_dtype(self.adapter_dtype)
        if not isinstance(self.fp16_overflow_guard, bool):
            raise ValueError(f"`fp16_overflow_guard` must be True or False, got {self.fp16_overflow_guard!r}.")
        for name, what in _UNSUPPORTED.items():
            if getattr(self, name, None):
                raise ValueError(
                    f"FastLoraConfig does not support {what}: got `{name}={getattr(self, name)!r}`. Unset it, or use "
                    "`peft.LoraConfig` for this adapter."
                )
        if self.init_lora_weights not in _SUPPORTED_INITS:
            raise ValueError(
                f"FastLoraConfig supports `init_lora_weights` in {_SUPPORTED_INITS}, got {self.init_lora_weights!r}: "
                "data-driven initialisations (PiSSA, OLoRA, CorDA, EVA, LoftQ) rewrite the quantized base weight. "
                "Use `peft.LoraConfig` for them."
            )
        super().__post_init__()
        self.peft_type = PEFT_TYPE_FASTLORA

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: Optional[str] = None, **kwargs):
        """PEFT's ``from_pretrained``; also remembers where the config came from (``config.loaded_from``, not saved),
        so the tuner can read that adapter's model card (the quantization it was trained on)."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        folder = Path(pretrained_model_name_or_path)
        config.loaded_from = folder / subfolder if subfolder else folder
        return config
