"""The one module that decides adapter dtypes.

``adapter_dtype`` policies (``FastLoraConfig.adapter_dtype``), resolved per layer from its compute dtype:

| policy           | compute fp16 | compute bf16 | compute fp32 |
|------------------|--------------|--------------|--------------|
| ``"bf16"``         | bf16         | bf16         | bf16         |
| ``"fp32-if-fp16"`` | fp32         | bf16         | fp32         |
| ``"fp32"``         | fp32         | fp32         | fp32         |

fp16 compute gets fp32 adapters because torch's GradScaler refuses to unscale fp16 (and, on CUDA, bf16) gradients.
The compute dtype of a ``Linear4bit`` is its ``compute_dtype`` (``bnb_4bit_compute_dtype``), except in an fp16 model,
where it is fp16: FastLoRA computes in the activation dtype, so an fp16 model trains with fp16 gradients whatever
``bnb_4bit_compute_dtype`` says. A ``Linear8bitLt`` has no compute dtype, so the model's dtype is used (the dtype the
model was loaded in, ``model.dtype``); any other layer uses its own weights' dtype. After an explicit cast of the
whole model (``model.half()``, ``model.float()``, ``model.to(torch.bfloat16)``) the activations have the cast dtype,
so it becomes every layer's compute dtype and the policy is applied again.
"""

from __future__ import annotations

from typing import Optional

import torch

ADAPTER_DTYPE_POLICIES = ("bf16", "fp32-if-fp16", "fp32")
DEFAULT_ADAPTER_DTYPE = "fp32-if-fp16"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_adapter_dtype(value: object) -> str:
    """Validates an ``adapter_dtype`` policy name and returns it."""
    if value not in ADAPTER_DTYPE_POLICIES:
        allowed = ", ".join(repr(p) for p in ADAPTER_DTYPE_POLICIES)
        raise ValueError(
            f"`adapter_dtype` must be one of {allowed}, got {value!r}. Use 'fp32-if-fp16' (the default) for fp16 "
            "training with GradScaler, or 'bf16' for the QLoRA paper's bf16 adapters."
        )
    return value


def resolve_adapter_dtype(policy: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Returns the adapter parameter dtype that ``policy`` gives for a layer computing in ``compute_dtype``."""
    check_adapter_dtype(policy)
    if policy == "bf16":
        return torch.bfloat16
    if policy == "fp32":
        return torch.float32
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32


def layer_compute_dtype(base_layer: torch.nn.Module, model_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The compute dtype that the policy is resolved against, for one base layer (see the module docstring)."""
    import bitsandbytes as bnb

    fallback = model_dtype if model_dtype in FLOAT_DTYPES else torch.float32
    if isinstance(base_layer, bnb.nn.Linear4bit):
        # FastLoRA computes in the activation dtype: an fp16 model runs fp16 whatever bnb_4bit_compute_dtype says,
        # and fp16 activations mean fp16 gradients and GradScaler.
        if model_dtype == torch.float16:
            return torch.float16
        compute = getattr(base_layer, "compute_dtype", None)
        return compute if compute in FLOAT_DTYPES else fallback
    if isinstance(base_layer, bnb.nn.Linear8bitLt):
        return fallback
    weight = getattr(base_layer, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype in FLOAT_DTYPES:
        return weight.dtype
    # Layers without a `weight` (nn.MultiheadAttention: in_proj_weight, out_proj.weight) compute in their own dtype.
    return next((p.dtype for p in base_layer.parameters() if p.dtype in FLOAT_DTYPES), fallback)


def model_float_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The model's dtype: ``model.dtype`` for transformers models, else its first floating-point parameter's."""
    dtype = getattr(model, "dtype", None)
    if dtype in FLOAT_DTYPES:
        return dtype
    for param in model.parameters():
        if param.dtype in FLOAT_DTYPES:
            return param.dtype
    return None


def apply_adapter_dtype_policy(
    model: torch.nn.Module, adapter_name: str, policy: str, compute_dtype: Optional[torch.dtype] = None
) -> None:
    """Casts every LoRA parameter of ``adapter_name`` in ``model`` to the dtype ``policy`` resolves to per layer.

    FastLoRA layers remember the resolved dtype and the policy (``layer.adapter_dtypes``, ``layer.adapter_policies``),
    so their forward can undo a later cast done outside peft_fastlora. Parameters stay the same objects (only
    ``.data`` changes), so an optimizer that already holds them keeps working.

    Args:
        model (`torch.nn.Module`): The tuner's model.
        adapter_name (`str`): The adapter to cast.
        policy (`str`): One of [`ADAPTER_DTYPE_POLICIES`].
        compute_dtype (`torch.dtype`, *optional*): The compute dtype of every layer, when the whole model was just
            cast to it (``model.half()``, ``.float()``, ``.to(dtype)``: the activations then have that dtype);
            by default each layer's own ([`layer_compute_dtype`]).
    """
    from peft.tuners.lora import LoraLayer

    check_adapter_dtype(policy)
    model_dtype = compute_dtype or model_float_dtype(model)
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        dtype = resolve_adapter_dtype(policy, compute_dtype or layer_compute_dtype(base, model_dtype))
        touched = False
        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            container = getattr(module, attr, None)
            if container is None or adapter_name not in container:
                continue
            item = container[adapter_name]
            params = [item] if isinstance(item, torch.nn.Parameter) else list(item.parameters())
            for param in params:
                if param.is_floating_point() and param.device.type != "meta":
                    param.data = param.data.to(dtype)
            touched = True
        if touched and hasattr(module, "adapter_dtypes"):
            module.adapter_dtypes[adapter_name] = dtype
            module.adapter_policies[adapter_name] = policy
            module.model_dtype = model_dtype


def float_cast_target(fn) -> Optional[torch.dtype]:
    """The float dtype that an ``nn.Module._apply`` function casts every float tensor to (``.half()``, ``.float()``,
    ``.bfloat16()``, ``.to(dtype)``), or ``None`` for one that keeps dtypes (``.to(device)``, ``.cuda()``, ...)."""
    try:
        probes = {fn(torch.empty(0, dtype=dtype)).dtype for dtype in (torch.float32, torch.bfloat16)}
    except Exception:  # not a plain tensor map (e.g. pin_memory without CUDA): not a dtype cast either
        return None
    dtype = probes.pop() if len(probes) == 1 else None
    return dtype if dtype in FLOAT_DTYPES else None


def override_adapter_dtype(model: torch.nn.Module, dtype: torch.dtype, param_ids: set[int]) -> list[torch.dtype]:
    """Casts the parameters whose ids are in ``param_ids`` to ``dtype`` and makes it every FastLoRA layer's policy
    dtype, replacing what ``adapter_dtype`` resolved to (FSDP needs one dtype for everything it shards together).

    Parameters stay the same objects (only ``.data`` changes). Returns the dtypes the cast parameters had.
    """
    recast = [p for p in model.parameters() if id(p) in param_ids and p.dtype != dtype]
    before = [p.dtype for p in recast]
    for param in recast:
        param.data = param.data.to(dtype)
    for module in model.modules():
        policies = getattr(module, "adapter_dtypes", None)
        if isinstance(policies, dict):
            for adapter in policies:
                policies[adapter] = dtype
    return before
