"""A clear error, before the first step, for fp16 training with adapters that torch's GradScaler cannot unscale.

fp16 mixed precision (``Trainer(fp16=True)`` on CUDA, accelerate's ``mixed_precision="fp16"``, or a loop with
``torch.autocast(dtype=torch.float16)`` and ``GradScaler``) unscales the gradients before each optimizer step.
GradScaler refuses fp16 gradients everywhere ("Attempting to unscale FP16 gradients.") and bf16 gradients on CUDA
(``"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'``). Both come at the first
optimizer step, from deep inside torch, and name neither the adapter nor the fix; this module raises one `ValueError`
that does.

Two entry points, sharing [`check_fp16_training`]:

- [`register_fp16_autocast_check`]: a forward pre-hook that runs the check once, at the first training forward under
  fp16 autocast (which is how Trainer, TRL and accelerate run fp16), then removes itself. Meant to be registered by
  ``FastLoraModel`` on itself, so every trainer gets it without configuration.
- [`FastLoraFp16Callback`]: a ``transformers.TrainerCallback`` that runs the check at ``on_train_begin`` when
  ``args.fp16`` is set, before any data is loaded.

The check reads the dtype that the ``adapter_dtype`` policy gives a FastLoRA adapter (``layer.adapter_dtypes``), not
its current dtype: a FastLoRA forward restores the policy after an outside cast (TRL casts the adapters of quantized
models to bf16), so such a cast is no error. Every other trainable parameter is checked at its current dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_HANDLE_ATTR = "_peft_fastlora_fp16_check_handle"
_MAX_NAMES = 3

try:  # transformers is a dependency; the guard only keeps this module importable without it
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover
    TrainerCallback = object


def effective_trainable_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each trainable floating-point parameter of ``model`` trains in.

    A FastLoRA adapter's is the one its ``adapter_dtype`` policy resolved to (its forward restores that dtype if
    something outside cast it); any other trainable parameter's is its current dtype.
    """
    from .layer import FastLoraLayer

    policy_dtype: dict[int, torch.dtype] = {}
    for module in model.modules():
        if not isinstance(module, FastLoraLayer):
            continue
        for adapter, dtype in module.adapter_dtypes.items():
            for container in (module.lora_A, module.lora_B):
                if adapter in container:
                    for param in container[adapter].parameters():
                        policy_dtype[id(param)] = dtype
    return {
        name: policy_dtype.get(id(param), param.dtype)
        for name, param in model.named_parameters()
        if param.requires_grad and param.is_floating_point()
    }


def _adapter_dtype_policies(model: nn.Module) -> list[str]:
    """The distinct ``adapter_dtype`` values of the FastLoRA configs found on ``model`` (a PeftModel or its tuner)."""
    configs = getattr(model, "peft_config", None)
    if configs is None:
        configs = getattr(getattr(model, "base_model", None), "peft_config", None) or {}
    return sorted({cfg.adapter_dtype for cfg in configs.values() if hasattr(cfg, "adapter_dtype")})


def check_fp16_training(model: nn.Module) -> None:
    """Raises a `ValueError` if fp16 mixed-precision training of ``model`` would hand GradScaler non-fp32 gradients.

    Args:
        model (`nn.Module`): The model about to be trained (a ``PeftModel``, its tuner, or any module).

    Raises:
        `ValueError`: naming the offending trainable parameters, the ``adapter_dtype`` policy and the fixes.
    """
    unsafe = {name: dtype for name, dtype in effective_trainable_dtypes(model).items() if dtype != torch.float32}
    if not unsafe:
        return
    names = list(unsafe)
    shown = ", ".join(f"{n} ({str(unsafe[n]).removeprefix('torch.')})" for n in names[:_MAX_NAMES])
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    policies = _adapter_dtype_policies(model)
    if not policies:
        policy = "no FastLoraConfig"
    elif len(policies) == 1:
        policy = f"FastLoraConfig has `adapter_dtype={policies[0]!r}`"
    else:
        policy = f"FastLoraConfigs have `adapter_dtype` in {policies}"
    raise ValueError(
        f"fp16 mixed-precision training needs fp32 trainable parameters, but {len(names)} are not: {shown}{more} "
        f"({policy}). torch's GradScaler cannot unscale fp16 gradients, nor "
        f"bf16 gradients on CUDA, and would fail at the first optimizer step. {_fix(policies)}"
    )


def _fix(policies: list[str]) -> str:
    """The fixes for [`check_fp16_training`], leaving out the policy the user already has."""
    if policies == ["fp32-if-fp16"]:
        return (
            "'fp32-if-fp16' gives fp32 adapters only to layers that compute in fp16, and these compute in bf16 "
            "(`bnb_4bit_compute_dtype=torch.bfloat16`, or a bf16 model). Fix: load the model with fp16 compute "
            "(`dtype=torch.float16`, `bnb_4bit_compute_dtype=torch.float16`), or use `adapter_dtype='fp32'`; or "
            "train in bf16 (`bf16=True`) instead of fp16."
        )
    return (
        "Fix: use `FastLoraConfig(adapter_dtype='fp32-if-fp16')` (the default) on a model whose compute dtype is fp16 "
        "(`dtype=torch.float16`, `bnb_4bit_compute_dtype=torch.float16`), or `adapter_dtype='fp32'` for any model; "
        "or train in bf16 (`bf16=True`) instead of fp16."
    )


def fp16_autocast_active(device_type: str) -> bool:
    """Whether fp16 autocast is on for ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16


def _first_trainable_device_type(model: nn.Module) -> Optional[str]:
    for param in model.parameters():
        if param.requires_grad:
            return param.device.type
    return None


def _fp16_check_hook(module: nn.Module, args) -> None:
    # A module-level function, not a closure: a model holding the hook must stay picklable (torch.save(model),
    # multiprocessing spawn, Ray, joblib), as stock PEFT models are.
    if not (module.training and torch.is_grad_enabled()):
        return
    device_type = _first_trainable_device_type(module)
    try:
        if device_type is not None and fp16_autocast_active(device_type):
            check_fp16_training(module)
    finally:
        remove_fp16_autocast_check(module)


def register_fp16_autocast_check(model: nn.Module) -> RemovableHandle:
    """Runs [`check_fp16_training`] on ``model`` at its first training forward under fp16 autocast.

    The hook removes itself after the first forward in training mode with grad enabled, whatever the precision, so it
    costs nothing afterwards. Registering twice keeps the first hook.

    Args:
        model (`nn.Module`): The module whose forward starts a training step (e.g. ``FastLoraModel``).

    Returns:
        `torch.utils.hooks.RemovableHandle`: removes the hook (also via [`remove_fp16_autocast_check`]).
    """
    existing = getattr(model, _HANDLE_ATTR, None)
    if existing is not None:
        return existing
    handle = model.register_forward_pre_hook(_fp16_check_hook)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def remove_fp16_autocast_check(model: nn.Module) -> None:
    """Removes the hook of [`register_fp16_autocast_check`] from ``model``, if any."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is not None:
        handle.remove()
        setattr(model, _HANDLE_ATTR, None)


class FastLoraFp16Callback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs [`check_fp16_training`] when training starts with ``fp16=True``.

    Example:

    ```py
    >>> trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), callbacks=[FastLoraFp16Callback()])
    ```
    """

    def on_train_begin(self, args, state, control, model: Optional[nn.Module] = None, **kwargs):
        if getattr(args, "fp16", False) and model is not None:
            check_fp16_training(model)
        return control
