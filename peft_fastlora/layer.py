"""``FastLoraLayer``: LoRA over a quantized base layer, computed by ``peft_fastlora.ops``.

The base weight is dequantized straight to the activation dtype on every call (never to the quant_state dtype), so
fp16, bf16 and fp32 activations all work on any checkpoint. The quantization backends (``bnb.py``) subclass this and
say how to read the quantized weight and how to store a merged one.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from . import ops
from .distributed import fsdp_owns_adapter_dtypes, fsdp_wraps_adapters
from .guard import clamp_fp16
from .ops.quant_state import QuantizedWeight

LOSSY_MERGE_WARNING = (
    "Merging a LoRA adapter into a quantized weight requantizes it, which loses most of a small trained delta. "
    "For a lossless merge use `model.merge_and_unload(dequantize=True)`, which returns an unquantized model."
)
RECAST_WARNING = (
    "FastLoRA adapter weights of '{adapter}' were cast to {found} outside peft_fastlora (for example by a trainer "
    "that casts trainable parameters); restoring the `adapter_dtype` policy's {policy}. Set `adapter_dtype` in "
    "FastLoraConfig instead of casting the adapters."
)


# Attribute holding ``(key, container)`` of the last quantized-weight container a backend built (see bnb.py).
WEIGHT_CACHE = "_fastlora_weight_cache"


def param(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``module.<name>`` for a parameter without ``nn.Module.__getattr__`` (a layer call reads several, on every layer
    of every step). FSDP1 may replace a parameter by a plain tensor attribute: then the normal lookup finds it."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


class FastLoraLayer(nn.Module, LoraLayer):
    """A LoRA layer whose base is a quantized linear layer; subclasses define the quantization backend.

    Args:
        base_layer (`nn.Module`): The quantized layer (or a LoRA layer wrapping it).
        adapter_name (`str`): Name of the first adapter.
        config ([`FastLoraConfig`]): The adapter's configuration.
        r (`int`): LoRA rank.
        lora_alpha (`int`): LoRA alpha.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        # Resolved `adapter_dtype` per adapter, filled by `peft_fastlora.dtypes.apply_adapter_dtype_policy`.
        self.adapter_dtypes: dict[str, torch.dtype] = {}
        self._recast_warned = False
        self.overflow_guard = bool(getattr(config, "fp16_overflow_guard", False))
        device = next((t.device for t in base_layer.parameters()), None)
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, `.half()` ... replace the weight tensors: drop the container that still references the
        # old ones, so they are freed now rather than at the next forward.
        self.__dict__.pop(WEIGHT_CACHE, None)
        return super()._apply(fn, *args, **kwargs)

    # ---- backend hooks -------------------------------------------------------------------------------------------
    def quantized_weight(self) -> QuantizedWeight:
        """The base weight as a plain-tensor container for ``peft_fastlora.ops``."""
        raise NotImplementedError

    def store_weight(self, weight: torch.Tensor) -> None:
        """Requantizes a full-precision ``(out_features, in_features)`` weight into the base layer."""
        raise NotImplementedError

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        # PEFT casts adapters to the base layer's dtype here; under `low_cpu_mem_usage=True` loading that would round
        # saved fp32 adapters through the compute dtype. Once the policy has resolved a dtype, move in that dtype.
        dtype = self.adapter_dtypes.get(adapter_name)
        if dtype is None:
            return super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        target = device if device is not None else self.get_base_layer().weight.device
        for attr in ("lora_A", "lora_B"):
            modules = getattr(self, attr)
            if adapter_name in modules and not any(p.is_meta for p in modules[adapter_name].parameters()):
                modules[adapter_name] = modules[adapter_name].to(target, dtype=dtype)

    def resolve_lora_variant(self, *, config, **kwargs):
        return None  # FastLoraConfig rejects DoRA and the other variants up front

    # ---- math ----------------------------------------------------------------------------------------------------
    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The base weight dequantized to ``dtype``."""
        return ops.dequantize(self.quantized_weight(), dtype)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``scaling * B @ A`` in fp32, shape ``(out_features, in_features)``."""
        a = self.lora_A[adapter].weight.float()
        b = self.lora_B[adapter].weight.float()
        return (b @ a) * self.scaling[adapter]

    def _lora_input(self, x: torch.Tensor, adapter: str) -> Optional[torch.Tensor]:
        dropout = self._modules["lora_dropout"]._modules[adapter]
        return None if isinstance(dropout, nn.Identity) else dropout(x)

    def _lora_delta(self, x: torch.Tensor, adapter: str, out_dtype: torch.dtype) -> torch.Tensor:
        """The LoRA term of one adapter, computed in the adapter dtype and returned in ``out_dtype``."""
        lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
        lora_x = self._lora_input(x, adapter)
        lx = (x if lora_x is None else lora_x).to(lora_a.weight.dtype)
        return (lora_b(lora_a(lx)) * self.scaling[adapter]).to(out_dtype)

    def _restore_adapter_dtypes(self, adapters: list[str]) -> None:
        """Undoes an outside cast of the adapters (e.g. TRL's bf16 cast) before it reaches GradScaler."""
        if fsdp_owns_adapter_dtypes(self):  # FSDP2 mixed precision: its param_dtype copies, the shards keep the policy
            return
        lora_a, lora_b = self._modules["lora_A"]._modules, self._modules["lora_B"]._modules
        for adapter in adapters:
            policy = self.adapter_dtypes.get(adapter)
            if policy is None:
                continue
            for module in (lora_a[adapter], lora_b[adapter]):
                found = param(module, "weight").dtype
                if found != policy:
                    if not self._recast_warned:  # once per layer; Python's filter folds the layers into one
                        warnings.warn(RECAST_WARNING.format(adapter=adapter, found=found, policy=policy), stacklevel=3)
                        self._recast_warned = True
                    module.to(policy)

    def _base(self) -> nn.Module:
        """``get_base_layer()`` through ``_modules`` lookups: PEFT's version pays an AttributeError on every call."""
        module = self
        while (inner := module._modules.get("base_layer")) is not None:
            module = inner
        return module

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Runs once per layer per step (and per decoded token): keep the host work small, it is what the GPU waits on
        # when the batch is small.
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is not None:
            self._check_forward_args(x, *args, adapter_names=adapter_names, **kwargs)
        merged = bool(self.merged_adapters)
        if self._disable_adapters and merged:
            self.unmerge()
            merged = False
        guard = self.overflow_guard and x.dtype == torch.float16
        if guard and self.overflow_count.device != x.device:  # layers placed after creation (device_map, .to)
            self.overflow_count = self.overflow_count.to(x.device)
        if guard:
            x = clamp_fp16(x, self.overflow_count)

        weight = self.quantized_weight()
        bias = param(self._base(), "bias")
        if self._disable_adapters or merged:
            adapters = []
        elif adapter_names is not None:
            adapters = sorted({a for a in adapter_names if a in self.lora_A})
        else:
            active = self.active_adapter
            adapters = [a for a in ((active,) if isinstance(active, str) else active) if a in self.lora_A]
        self._restore_adapter_dtypes(adapters)

        if adapter_names is not None or not adapters or fsdp_wraps_adapters(self, adapters):
            # Base through the kernels; LoRA through the adapter modules (mixed batches, or FSDP units that only
            # gather their weights inside their own forward).
            result = ops.fastlora_linear(x, weight, bias, None, None, 1.0)
            if adapter_names is not None:
                result = self._add_mixed_batch(result, x, adapter_names, adapters)
            else:
                for adapter in adapters:
                    result = result + self._lora_delta(x, adapter, result.dtype)
        else:
            first = adapters[0]
            result = ops.fastlora_linear(
                x,
                weight,
                bias,
                param(self._modules["lora_A"]._modules[first], "weight"),
                param(self._modules["lora_B"]._modules[first], "weight"),
                self.scaling[first],
                lora_x=self._lora_input(x, first),
            )
            for adapter in adapters[1:]:
                result = result + self._lora_delta(x, adapter, result.dtype)
        if guard:
            result = clamp_fp16(result, self.overflow_count)
        return result

    def _add_mixed_batch(self, result, x, adapter_names: list[str], adapters: list[str]) -> torch.Tensor:
        """Adds each sample's own adapter (``adapter_names[i]``; ``"__base__"`` means none) to ``result``."""
        for adapter in adapters:
            rows = [i for i, name in enumerate(adapter_names) if name == adapter]
            result[rows] += self._lora_delta(x[rows], adapter, result.dtype)
        return result

    # ---- merging -------------------------------------------------------------------------------------------------
    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Merges adapters into the quantized weight by requantizing it (lossy; warns).

        Args:
            safe_merge (`bool`): Check the merged weight for NaN/inf before storing it.
            adapter_names (`list[str]`, *optional*): Adapters to merge; defaults to the active ones.
        """
        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A:
                continue
            warnings.warn(LOSSY_MERGE_WARNING, stacklevel=2)
            merged = self.dequantized_weight(torch.float32) + self.get_delta_weight(adapter)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights: adapter {adapter!r} seems to be broken.")
            self.store_weight(merged)
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        """Subtracts the merged adapters from the quantized weight again (lossy, like `merge`)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A:
                self.store_weight(self.dequantized_weight(torch.float32) - self.get_delta_weight(adapter))

    def dequantize_and_merge(self, adapter_names: Optional[list[str]] = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding the dequantized base plus the adapters, in the layer's compute dtype.

        Lossless up to that dtype's rounding: nothing is requantized.
        """
        from .dtypes import layer_compute_dtype

        base = self.get_base_layer()
        # The merged layer must take the activations the model feeds it: the model's dtype when known.
        model_dtype = getattr(self, "model_dtype", None)
        dtype = model_dtype if model_dtype is not None else layer_compute_dtype(base, None)
        weight = self.dequantized_weight(torch.float32)
        if self.merged:  # the quantized weight already contains these; take them out first
            for adapter in self.merged_adapters:
                weight = weight - self.get_delta_weight(adapter)
        names = adapter_names if adapter_names is not None else [a for a in self.active_adapters if a in self.lora_A]
        for adapter in names:
            weight = weight + self.get_delta_weight(adapter)
        linear = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None, device=weight.device,
                           dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if base.bias is not None:
                linear.bias.copy_(base.bias)
        linear.requires_grad_(False)
        return linear

    def __repr__(self) -> str:
        return "fastlora." + super().__repr__()
