"""``FastLoraLayer``: LoRA over a quantized base layer, computed by ``peft_fastlora.ops``.

The base weight is dequantized straight to the activation dtype on every call (never to the quant_state dtype), so
fp16, bf16 and fp32 activations all work on any checkpoint. The quantization backends (``bnb.py``) subclass this and
say how to read the quantized weight and how to store a merged one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from . import ops
from .dtypes import layer_compute_dtype
from .guard import clamp_fp16
from .ops.quant_state import QuantizedWeight

LOSSY_MERGE_WARNING = (
    "Merging a LoRA adapter into a quantized weight requantizes it, which loses most of a small trained delta. "
    "For a lossless merge use `model.merge_and_unload(dequantize=True)`, which returns an unquantized model."
)


class RecastNotice:
    """Whether the adapter recast warning was given, shared by the layers of one model so that a cast of the whole
    model warns once. Python's once-per-location filter cannot do that: code that changes the warning filters during
    a forward (``catch_warnings``, as libraries on the CUDA path do) resets it, and an H100 run of TRL's cast warned
    two and three times."""

    __slots__ = ("given",)

    def __init__(self) -> None:
        self.given = False


RECAST_WARNING = (
    "FastLoRA adapter weights of '{adapter}' were cast to {found} outside peft_fastlora (for example by a trainer "
    "that casts trainable parameters); restoring the `adapter_dtype` policy's {policy}. Set `adapter_dtype` in "
    "FastLoraConfig instead of casting the adapters."
)
FP32_ACTIVATIONS_WARNING = (
    "A FastLoRA 4-bit layer configured to compute in {compute} (`bnb_4bit_compute_dtype`) receives float32 "
    "activations, so it dequantizes and multiplies in float32: several times slower on a GPU. This happens after "
    "`prepare_model_for_kbit_training` (it upcasts the norms and embeddings) or with an fp32 model. Fix: run the "
    "forward under `torch.autocast('cuda', dtype={compute_name})`, or pass `bf16=True` (or `fp16=True`) to the "
    "Trainer, which does that for you."
)

# The one cache of the tuner: each FastLoRA layer keeps, in this instance attribute, ``(key, container)`` for the
# last quantized-weight container its backend built (`FastLoraLayer.cached_weight`). The key is the backend's
# identity of the weight (storage pointer, device, quant_state / scales identity), so a merge, a device move, an FSDP
# all-gather or a new quant_state builds a new container. `_apply` (`.to()`, `.half()`, ...) and
# `invalidate_weight_cache` drop it. The kernels keep their validated launch arguments on the container, which is
# what makes reusing it worth a cache.
WEIGHT_CACHE = "_fastlora_weight_cache"
# The decode lanes: per (input shape, dtype, device), the small-M call prepared by `ops.prepare_small_m_call` for the
# adapter it was built for, with the layer state it was built in (`FastLoraLayer._lane_state`: everything `forward`
# reads to choose and feed that call, except the scaling, read per call). A call whose state equals the lane's runs
# the prepared call; any change (adapter switch, merge, disable, new tensors, dropout on, autocast to another dtype)
# takes the general path, which builds a new lane. Dropped with the weight cache. At most MAX_LANES shapes.
DECODE_LANES = "_fastlora_decode_lanes"
# The training lanes: the same for calls with grad mode on, whose adapters (or bias) train, each holding the call
# prepared by `ops.prepare_training_call` (the autograd op, its path already chosen and its arguments checked). A
# batch-1 training step waits on the host, and re-deciding the path costs as much as a kernel launch per layer call.
TRAIN_LANES = "_fastlora_train_lanes"
MAX_LANES = 8


def _import_fsdp_wrapper_types() -> tuple:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FullyShardedDataParallel, FSDPModule)


# A constant, not a cached function: torch.compile traces every layer call through `adapters_are_fsdp_units`, and
# dynamo warns about (and ignores) a functools cache it meets. PEFT has imported torch.distributed.fsdp already.
FSDP_WRAPPER_TYPES = _import_fsdp_wrapper_types()


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

    bits: int = 0  # set by each backend: 4 or 8

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        # Resolved `adapter_dtype` per adapter, and the policy name it came from; filled by
        # `peft_fastlora.dtypes.apply_adapter_dtype_policy`.
        self.adapter_dtypes: dict[str, torch.dtype] = {}
        self.adapter_policies: dict[str, str] = {}
        # Whether the recast warning was given; FastLoraModel hands all its layers one shared notice.
        self.recast_notice = RecastNotice()
        # Set by `peft_fastlora.distributed.prepare_for_fsdp` for FSDP2: its mixed precision computes with its own
        # `param_dtype` copies of the adapters (the shards keep the policy's dtype), which must not be cast back.
        self.fsdp2_prepared = False
        self._activations_checked = False
        self.overflow_guard = bool(getattr(config, "fp16_overflow_guard", False))
        device = next((t.device for t in base_layer.parameters()), None)
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, `.half()` ... replace the weight tensors: drop the container that still references the
        # old ones, so they are freed now rather than at the next forward.
        self.invalidate_weight_cache()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict:
        # Pickling and deepcopy leave the lanes and the weight container behind: the lanes hold launch closures (not
        # picklable) bound to this layer's tensors, the container the kernels' launch arguments (the kernel objects
        # among them); the copy builds its own on its first call.
        state = super().__getstate__()
        for key in (DECODE_LANES, TRAIN_LANES, WEIGHT_CACHE):
            state.pop(key, None)
        return state

    # ---- the weight-container cache (see WEIGHT_CACHE) ---------------------------------------------------------------
    def cached_weight(self, key: tuple, build: Callable[[], QuantizedWeight]) -> QuantizedWeight:
        """The container cached for ``key``, or ``build()``'s, which then replaces the cached one."""
        cached = self.__dict__.get(WEIGHT_CACHE)
        if cached is None or cached[0] != key:
            cached = (key, build())
            self.__dict__[WEIGHT_CACHE] = cached
        return cached[1]

    def invalidate_weight_cache(self) -> None:
        """Drops the cached container and the prepared decode calls (call it after changing the base weight in place,
        e.g. re-viewing it)."""
        self.__dict__.pop(WEIGHT_CACHE, None)
        self.__dict__.pop(DECODE_LANES, None)
        self.__dict__.pop(TRAIN_LANES, None)

    # ---- backend hooks -----------------------------------------------------------------------------------------------
    def quantized_weight(self) -> QuantizedWeight:
        """The base weight as a plain-tensor container for ``peft_fastlora.ops``."""
        raise NotImplementedError

    def weight_key(self) -> Optional[tuple]:
        """The identity of the base weight (storage pointer, device, quantization state): what the container cache
        is keyed by. None when the weight must be repaired first (``quantized_weight`` does that)."""
        return None

    def store_weight(self, weight: torch.Tensor) -> None:
        """Requantizes a full-precision ``(out_features, in_features)`` weight into the base layer."""
        raise NotImplementedError

    def configured_compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype the backend was configured to compute in (4-bit: ``bnb_4bit_compute_dtype``), or ``None``."""
        return None

    # ---- PEFT hooks --------------------------------------------------------------------------------------------------
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

    # ---- FSDP --------------------------------------------------------------------------------------------------------
    def adapters_are_fsdp_units(self, adapters: list[str]) -> bool:
        """Whether FSDP made ``lora_A`` / ``lora_B`` of these adapters units of their own (FSDP1 or FSDP2).

        PEFT's ``fsdp_auto_wrap_policy`` does this, and the HF Trainer installs it for every PEFT model under FSDP.
        Such a unit gathers its weight only inside its own forward, so the layer must then call the adapter modules
        instead of handing their weights to the fused op (which would see the flat shard).
        """
        wrappers = FSDP_WRAPPER_TYPES
        if not wrappers:
            return False
        lora_a, lora_b = self._modules["lora_A"]._modules, self._modules["lora_B"]._modules  # every forward: no getattr
        return any(isinstance(lora_a[a], wrappers) or isinstance(lora_b[a], wrappers) for a in adapters)

    # ---- math --------------------------------------------------------------------------------------------------------
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
        if self.fsdp2_prepared:  # FSDP2 mixed precision: its param_dtype copies, the shards keep the policy
            return
        lora_a, lora_b = self._modules["lora_A"]._modules, self._modules["lora_B"]._modules
        for adapter in adapters:
            policy = self.adapter_dtypes.get(adapter)
            if policy is None:
                continue
            for module in (lora_a[adapter], lora_b[adapter]):
                found = param(module, "weight").dtype
                if found != policy:
                    if not self.recast_notice.given:
                        # The caller's frame is torch's Module.__call__, so the warning points at this line.
                        warnings.warn(RECAST_WARNING.format(adapter=adapter, found=found, policy=policy), stacklevel=1)
                        self.recast_notice.given = True
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
        if not kwargs and not torch.compiler.is_compiling():
            lanes = self.__dict__.get(TRAIN_LANES if torch.is_grad_enabled() else DECODE_LANES)
            lane = lanes.get((x.shape, x.dtype, x.device)) if lanes else None
            if lane is not None and self._lane_state(x, lane[0]) == lane[1]:
                return lane[2](x, 1.0 if lane[0] is None else self.scaling[lane[0]])
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is not None:
            self._check_forward_args(x, *args, adapter_names=adapter_names, **kwargs)
        if not self._activations_checked:
            self._check_activation_dtype(x)
        merged = bool(self.merged_adapters)
        disabled = self.disable_adapters
        if disabled and merged:
            self.unmerge()
            merged = False
        guard = self.overflow_guard and x.dtype == torch.float16
        if guard:
            x = clamp_fp16(x, self._overflow_counter(x))

        weight = self.quantized_weight()
        bias = param(self._base(), "bias")
        if disabled or merged:
            adapters = []
        elif adapter_names is not None:
            adapters = sorted({a for a in adapter_names if a in self.lora_A})
        else:
            adapters = self._active_present()
        self._restore_adapter_dtypes(adapters)

        fsdp_units = bool(adapters) and self.adapters_are_fsdp_units(adapters)
        lane_ok = adapter_names is None and not guard
        lane_ok = lane_ok and not torch.compiler.is_compiling()  # graphs need no lane: dynamo skips the host work
        if lane_ok and len(adapters) <= 1 and not fsdp_units:
            result = self._lane_call(x, weight, bias, adapters[0] if adapters else None)
            if result is not None:
                return result
        if adapter_names is not None or not adapters or fsdp_units:
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

    # ---- decode lanes (see DECODE_LANES) -------------------------------------------------------------------------
    def _lane_state(self, x: torch.Tensor, adapter: Optional[str]) -> Optional[tuple]:
        """What ``forward`` reads to choose and feed a single fused call on ``x`` with ``adapter`` (None: the base
        alone), other than the shape, dtype and device of ``x`` (the lanes' key); None when no lane may serve it."""
        weight_key = self.weight_key()  # callers are not under torch.compile (see forward)
        if weight_key is None:
            return None
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x.dtype
        base = self._base()
        bias = param(base, "bias")
        active = self._active_adapter
        lora_a = self._modules["lora_A"]._modules
        state = (weight_key, None if bias is None else (bias.data_ptr(), bias.requires_grad), autocast,
                 self.disable_adapters, bool(self.merged_adapters), self.overflow_guard and x.dtype == torch.float16,
                 active if isinstance(active, str) else tuple(active), tuple(lora_a))  # fmt: skip
        if adapter is None:
            return state
        module_a, module_b = lora_a.get(adapter), self._modules["lora_B"]._modules.get(adapter)
        if module_a is None or module_b is None:
            return None
        weight_a, weight_b = param(module_a, "weight"), param(module_b, "weight")
        return state + (type(module_a), type(module_b), weight_a.data_ptr(), weight_b.data_ptr(), weight_a.dtype,
                        weight_b.dtype, weight_a.requires_grad, weight_b.requires_grad,
                        self._lora_reads_x(adapter))  # fmt: skip

    def _lora_reads_x(self, adapter: str) -> bool:
        """Whether ``adapter``'s LoRA branch reads the layer input itself (its dropout is off or an identity)."""
        dropout = self._modules["lora_dropout"]._modules[adapter]
        return type(dropout) is nn.Identity or not dropout.training

    def _lane_call(self, x, weight, bias, adapter: Optional[str]) -> Optional[torch.Tensor]:
        """Builds the lane for ``x`` and ``adapter`` (see DECODE_LANES and TRAIN_LANES) and runs it; None when no
        lane applies (the caller then takes the general path)."""
        training = torch.is_grad_enabled()
        lora_a = lora_b = None
        if adapter is not None:
            if not self._lora_reads_x(adapter):  # a lane feeds x to the LoRA branch
                return None
            lora_a = param(self._modules["lora_A"]._modules[adapter], "weight")
            lora_b = param(self._modules["lora_B"]._modules[adapter], "weight")
        elif training:  # the base alone: its path depends on whether x needs a grad, call by call
            return None
        # None off the small-M path (decode) or the autograd op's (training: the adapters or the bias train), and
        # under autocast to another dtype (the general path casts x first).
        if training:
            run = ops.prepare_training_call(x, weight, bias, lora_a, lora_b)
        else:
            run = ops.prepare_small_m_call(x, weight, bias, lora_a, lora_b)
        state = None if run is None else self._lane_state(x, adapter)
        if state is None:
            return None
        lanes = self.__dict__.setdefault(TRAIN_LANES if training else DECODE_LANES, {})
        # Lanes of another base weight (merged, requantized, re-gathered) would keep that weight alive: drop them.
        if len(lanes) >= MAX_LANES or any(lane[1][0] != state[0] for lane in lanes.values()):
            lanes.clear()
        lanes[(x.shape, x.dtype, x.device)] = (adapter, state, run)
        return run(x, 1.0 if adapter is None else self.scaling[adapter])

    def _active_present(self) -> list[str]:
        """The active adapters this layer holds (PEFT's ``active_adapters`` property costs more on every call)."""
        active = self.active_adapter
        return [a for a in ((active,) if isinstance(active, str) else active) if a in self.lora_A]

    def single_adapter_args(self, x: torch.Tensor) -> Optional[tuple]:
        """``(weight, bias, lora_a, lora_b, scaling)`` when this layer's forward on ``x`` would be exactly one
        ``fastlora_linear`` call on ``x`` itself (one active adapter, no dropout, nothing merged or disabled, no fp16
        guard, adapters not FSDP units), else None. Lets a caller fuse the producer of ``x`` into the op
        (``peft_fastlora.fast_path``'s SwiGLU down projection)."""
        if self.merged_adapters or self.disable_adapters or (self.overflow_guard and x.dtype == torch.float16):
            return None
        adapters = self._active_present()
        if len(adapters) != 1 or self.adapters_are_fsdp_units(adapters):
            return None
        (adapter,) = adapters
        if not isinstance(self._modules["lora_dropout"]._modules[adapter], nn.Identity):
            return None
        if not self._activations_checked:
            self._check_activation_dtype(x)
        self._restore_adapter_dtypes(adapters)
        return (
            self.quantized_weight(),
            param(self._base(), "bias"),
            param(self._modules["lora_A"]._modules[adapter], "weight"),
            param(self._modules["lora_B"]._modules[adapter], "weight"),
            self.scaling[adapter],
        )

    def _overflow_counter(self, x: torch.Tensor) -> torch.Tensor:
        """The guard's counter, on ``x``'s device and updatable here (not an inference tensor outside inference
        mode, as one created or moved under ``torch.inference_mode()`` would be)."""
        counter = self.overflow_count
        if counter.device != x.device or (counter.is_inference() and not torch.is_inference_mode_enabled()):
            with torch.inference_mode(False):
                self.overflow_count = counter = counter.to(x.device).clone()
        return counter

    def _check_activation_dtype(self, x: torch.Tensor) -> None:
        """Warns (once per process, through Python's warning filter) when fp32 activations reach a layer configured
        for 16-bit compute without autocast: FastLoRA then computes in fp32, which is slow on a GPU. Skipped while
        torch.compile traces (no side effects in a graph); the first eager call checks."""
        if torch.compiler.is_compiling():
            return
        self._activations_checked = True
        compute = self.configured_compute_dtype()
        if x.dtype != torch.float32 or compute not in (torch.float16, torch.bfloat16):
            return
        if torch.is_autocast_enabled(x.device.type):
            return
        name = str(compute).removeprefix("torch.")
        warnings.warn(FP32_ACTIVATIONS_WARNING.format(compute=name, compute_name=f"torch.{name}"), stacklevel=3)

    def _add_mixed_batch(self, result, x, adapter_names: list[str], adapters: list[str]) -> torch.Tensor:
        """Adds each sample's own adapter (``adapter_names[i]``; ``"__base__"`` means none) to ``result``."""
        for adapter in adapters:
            rows = [i for i, name in enumerate(adapter_names) if name == adapter]
            result[rows] += self._lora_delta(x[rows], adapter, result.dtype)
        return result

    # ---- merging -----------------------------------------------------------------------------------------------------
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
        base = self.get_base_layer()
        # The merged layer must take the activations the model feeds it: the model's dtype when known.
        model_dtype = getattr(self, "model_dtype", None)
        dtype = model_dtype if model_dtype is not None else layer_compute_dtype(base, None)
        weight = self.dequantized_weight(torch.float32)
        if self.merged:  # the quantized weight already contains these; take them out first
            for adapter in self.merged_adapters:
                weight = weight - self.get_delta_weight(adapter)
        names = adapter_names if adapter_names is not None else self.active_adapters
        for adapter in (a for a in names if a in self.lora_A):  # an adapter need not target every layer
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
