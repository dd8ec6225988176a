"""FastLoRA under ``torch.distributed``: DDP needs nothing from here; FSDP needs [`prepare_for_fsdp`].

DDP (``torchrun``, ``accelerate launch --multi_gpu``, the HF Trainer) works as is: FastLoRA layers are ordinary modules
whose adapters get a gradient on every step, so ``find_unused_parameters=False``, gradient checkpointing and
``modules_to_save`` all work.

FSDP shards parameters. [`prepare_for_fsdp`] follows the FSDP version (``fsdp_version``; see
[`resolve_fsdp_version`]):

- **FSDP2** (``torch.distributed.fsdp.fully_shard``, accelerate ``fsdp_version: 2``). FSDP2 all-gathers the
  parameters of one unit through one buffer. When they share one float dtype it copies them as floats, and on CUDA
  that rewrites every 16-bit word whose bits read as a NaN to the canonical NaN (packed 4-bit codes stored as
  bf16/fp16 then decode to other weights); under mixed precision it also casts float parameters by value. Non-float
  parameters get neither: they are never cast, and a unit holding one is all-gathered as ``uint8``. So every packed
  4-bit weight is re-viewed as ``uint8`` (bitsandbytes' default layout, whatever ``bnb_4bit_quant_storage`` was), and
  FSDP2 moves its bytes. torch < 2.12 cannot shard non-float parameters (``fully_shard`` raises "only Tensors of
  floating point dtype can require gradients"): there the packed weights stay whole on every GPU, passed to
  ``fully_shard`` as ``ignored_params`` ([`fsdp2_ignored_params`]); accelerate 1.15 leaves non-float ``Params4bit``
  out of FSDP2 by itself. FSDP2 needs one dtype among the *trainable* parameters of a unit, nothing else, so the
  adapters keep the ``adapter_dtype`` policy's dtype (with fp32 adapters and a bf16 ``modules_to_save`` copy, keep
  them in different units: every decoder layer its own unit, as accelerate does; a log line says so). FastLoRA layers
  leave FSDP2's mixed-precision copies of the adapters alone (``FastLoraLayer.fsdp2_prepared``).
- **FSDP1** (``FullyShardedDataParallel``, accelerate ``fsdp_version: 1``) flattens all parameters of a unit into one
  tensor of one dtype, and its mixed precision casts float parameters to ``param_dtype`` (the HF Trainer sets it to
  ``bnb_4bit_quant_storage``). So the packed 4-bit weights must be stored as a float dtype equal to the model dtype
  (``BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16)`` with ``dtype=torch.bfloat16``), and the adapters
  take that dtype instead of the ``adapter_dtype`` policy's (one log line says so). FSDP1 copies flat parameters as
  bytes, so it does not rewrite NaN words.

Both: FSDP replaces each ``Params4bit`` by a plain all-gathered tensor, which has no ``quant_state``; bitsandbytes keeps
the state on the module (``Linear4bit.quant_state``) and ``peft_fastlora.bnb.restore_quant_state`` puts it back when a
FastLoRA layer reads its weight (after FSDP's all-gather). PEFT's ``fsdp_auto_wrap_policy`` (installed by the HF
Trainer for PEFT models under FSDP1) makes every ``lora_A`` / ``lora_B`` a unit of its own, whose weight is gathered
only inside that module's forward; a FastLoRA layer then calls those modules rather than read their weights
(``FastLoraLayer.adapters_are_fsdp_units``).

This module sits above the tuner (it imports the layers); nothing in the tuner imports it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from ..bnb import FastLoraLinear4bit, FastLoraLinear8bit, is_quantized_4bit, view_packed_as_bytes
from ..dtypes import FLOAT_DTYPES, override_adapter_dtype
from ..layer import FastLoraLayer

logger = logging.getLogger(__name__)

FSDP_VERSIONS = (1, 2)
DEFAULT_FSDP_VERSION = 2  # torch's current FSDP API (`fully_shard`), and transformers' default
# torch 2.12 shards non-float parameters with FSDP2 (before, `fully_shard` made them require grad and raised).
FSDP2_SHARDS_BYTES = torch.__version__ >= "2.12"
STORAGE_FIX = (
    "Load the model with a float `bnb_4bit_quant_storage` equal to its dtype, e.g. "
    "`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16, ...)` and `dtype=torch.bfloat16`. "
    "Under FSDP1 the adapters then take that dtype too, whatever `adapter_dtype` says. FSDP2 (`fsdp_version=2`) takes "
    "any `bnb_4bit_quant_storage`."
)


class FSDPConfigError(ValueError):
    """Raised by [`prepare_for_fsdp`] for a model that FSDP cannot shard correctly."""


def is_main_process() -> bool:
    """Whether this is rank 0 of an initialized process group, or there is none."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def resolve_fsdp_version(fsdp_version: Optional[int] = None) -> int:
    """The FSDP version [`prepare_for_fsdp`] prepares for: ``fsdp_version`` when given, else accelerate's setting.

    accelerate's setting is the ``FSDP_VERSION`` environment variable (``accelerate launch`` sets it from
    ``fsdp_version`` in its config; its FSDP plugin reads it too), or 1, accelerate's default, when only
    ``ACCELERATE_USE_FSDP`` is set. Without either, [`DEFAULT_FSDP_VERSION`] (2: ``fully_shard``).

    Args:
        fsdp_version (`int`, *optional*): 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``).

    Raises:
        `ValueError`: for any other value, or an ``FSDP_VERSION`` that is not one of them.
    """
    if fsdp_version is None:
        env = os.environ.get("FSDP_VERSION")
        if env is None:
            return 1 if fsdp_launched() else DEFAULT_FSDP_VERSION
        if env.strip() not in ("1", "2"):
            raise ValueError(
                f"The environment variable `FSDP_VERSION` must be 1 or 2, got {env!r}. Set `fsdp_version: 1` or "
                "`fsdp_version: 2` in the accelerate config, or pass `fsdp_version=` to `prepare_for_fsdp`."
            )
        return int(env)
    if not isinstance(fsdp_version, int) or isinstance(fsdp_version, bool) or fsdp_version not in FSDP_VERSIONS:
        raise ValueError(
            f"`fsdp_version` must be 1 (`FullyShardedDataParallel`) or 2 (`fully_shard`), got {fsdp_version!r}. "
            "Pass the version you will wrap the model with, or None to follow accelerate's `FSDP_VERSION`."
        )
    return fsdp_version


def _check_shardable_layers(model: nn.Module) -> None:
    """Raises for 8-bit layers and for a model that FSDP already wrapped."""
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, FastLoraLinear8bit):
            raise FSDPConfigError(
                f"FSDP cannot shard bitsandbytes 8-bit weights (layer {name!r}): they are int8 tensors whose row "
                "scales (`SCB`) are attributes that FSDP's all-gathered tensor does not carry. Use 4-bit loading, or "
                "DDP."
            )
    sharded = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:
        raise FSDPConfigError(
            f"`prepare_for_fsdp` must run before FSDP wraps the model, but {sharded!r} is already sharded (a DTensor). "
            "Call it right after `get_peft_model`, before `fully_shard` / `Trainer(...)`."
        )


def _storage_dtypes(model: nn.Module) -> dict[torch.dtype, str]:
    """``{packed weight dtype: name of one layer}`` over the FastLoRA 4-bit layers."""
    found: dict[torch.dtype, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, FastLoraLinear4bit):
            found.setdefault(module.get_base_layer().weight.dtype, name)
    return found


def _adapter_params(model: nn.Module) -> set[int]:
    """ids of the parameters that take the storage dtype: every trainable one and every LoRA weight (even frozen)."""
    return {id(p) for p in model.parameters() if p.requires_grad} | {id(p) for p in _lora_params(model)}


def _lora_params(model: nn.Module) -> list[nn.Parameter]:
    return [
        p
        for module in model.modules()
        if isinstance(module, LoraLayer)
        for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
        if getattr(module, attr, None) is not None
        for p in getattr(module, attr).parameters()
    ]


def _adapter_policies(model: nn.Module) -> str:
    configs = getattr(model, "peft_config", None) or {}
    names = sorted({getattr(c, "adapter_dtype", None) for c in configs.values()} - {None})
    return ", ".join(repr(n) for n in names) or "?"


def _prepare_fsdp1(model: nn.Module) -> None:
    """FSDP1: one float storage dtype equal to the model's, adapters cast to it (logged).

    Saving under FSDP1 needs two more fixes, installed at import time: PEFT 0.21 picks adapter keys by module names
    that FSDP1 nesting changes (`_registry.hook_adapter_state_dict`), and a `modules_to_save` unit all-gathers its
    state on the main process only (`saving.fsdp1_module_state_from`).
    """
    storages = _storage_dtypes(model)
    if not storages:
        return
    bad = {d: n for d, n in storages.items() if d not in FLOAT_DTYPES}
    if bad:
        dtype, name = next(iter(bad.items()))
        raise FSDPConfigError(
            f"FSDP1 needs 4-bit weights stored as a float dtype, but `bnb_4bit_quant_storage` is {dtype} (layer "
            f"{name!r}): FSDP1 cannot flatten them with the other parameters. {STORAGE_FIX}"
        )
    if len(storages) > 1:
        raise FSDPConfigError(
            f"FSDP1 needs one `bnb_4bit_quant_storage` for the whole model, found {sorted(map(str, storages))}. "
            f"{STORAGE_FIX}"
        )
    target = next(iter(storages))
    adapters = _adapter_params(model)
    frozen = [
        (n, p.dtype)
        for n, p in model.named_parameters()
        if id(p) not in adapters and p.is_floating_point() and p.dtype != target and type(p).__name__ != "Params4bit"
    ]
    if frozen:
        name, dtype = frozen[0]
        raise FSDPConfigError(
            f"FSDP1 needs the model's float parameters in the 4-bit storage dtype {target} "
            f"(`bnb_4bit_quant_storage`), but {len(frozen)} frozen parameters are not (e.g. {name!r} is {dtype}). "
            f"Load the model with `dtype={target}` and do not upcast its parameters afterwards (e.g. with "
            "`prepare_model_for_kbit_training`)."
        )
    recast = override_adapter_dtype(model, target, adapters)
    before = ", ".join(sorted({str(d) for d in recast}))
    if recast and is_main_process():
        logger.warning(
            "peft_fastlora: FSDP: cast %d adapter parameters (adapter_dtype=%s gave %s) to %s, the "
            "`bnb_4bit_quant_storage` dtype, because FSDP shards them together with the 4-bit weights.",
            len(recast), _adapter_policies(model), before, target,
        )


def _view_packed_as_bytes(model: nn.Module) -> int:
    """Re-views every bitsandbytes 4-bit weight as ``uint8`` (``bnb.view_packed_as_bytes``); returns how many changed.

    The ``Params4bit`` objects stay the same, so optimizers and FSDP see the same parameters over the same bytes.
    """
    for name, module in model.named_modules():
        if is_quantized_4bit(module) and getattr(module.weight, "quant_state", None) is None:
            raise FSDPConfigError(
                f"The 4-bit layer {name!r} is not quantized (its weight has no `quant_state`; e.g. it is still on the "
                "meta device, as with `cpu_ram_efficient_loading`). Load the quantized model on every rank before "
                "`prepare_for_fsdp`."
            )
    changed = 0
    for module in model.modules():
        if isinstance(module, FastLoraLayer):
            module.invalidate_weight_cache()  # its container still holds the old view
        elif is_quantized_4bit(module):
            changed += view_packed_as_bytes(module)
    return changed


def _trainable_dtypes(model: nn.Module) -> dict[str, list[str]]:
    """``{"adapters" / "other": sorted dtypes}`` of the trainable parameters (LoRA weights / everything else)."""
    lora = {id(p) for p in _lora_params(model)}
    found: dict[str, set[str]] = {"adapters": set(), "other": set()}
    for param in model.parameters():
        if param.requires_grad:
            found["adapters" if id(param) in lora else "other"].add(str(param.dtype))
    return {k: sorted(v) for k, v in found.items() if v}


def _prepare_fsdp2(model: nn.Module) -> None:
    """FSDP2: packed weights as bytes; dtypes of the trainable parameters kept, their mixed-precision casts left to
    FSDP2."""
    viewed = _view_packed_as_bytes(model)
    for module in model.modules():
        if isinstance(module, FastLoraLayer):
            module.fsdp2_prepared = True
    if not is_main_process():
        return
    trainable = _trainable_dtypes(model)
    logger.info(
        "peft_fastlora: FSDP2: %d packed 4-bit weights re-viewed as uint8, so FSDP2 all-gathers their bytes; the "
        "trainable parameters keep their dtypes (adapter_dtype=%s): %s.", viewed, _adapter_policies(model), trainable,
    )
    if len({d for dtypes in trainable.values() for d in dtypes}) > 1:
        # A modules_to_save copy must stay in the activation dtype, so casting it to fp32 adapters' dtype would break
        # a forward without mixed precision; casting fp32 adapters down would drop the policy. Separate units work.
        logger.warning(
            "peft_fastlora: FSDP2: the trainable parameters have several dtypes (%s), and FSDP2 needs one dtype among "
            "the trainable parameters of each unit (\"FSDP expects uniform original parameter dtype\"). Keep them "
            "in different units (`fully_shard` every decoder layer, as accelerate does: the adapters are inside the "
            "layers), or choose an `adapter_dtype` that gives the adapters the other parameters' dtype.",
            trainable,
        )
    if not FSDP2_SHARDS_BYTES and fsdp2_ignored_params(model):
        logger.warning(
            "peft_fastlora: FSDP2: torch %s cannot shard uint8 parameters (torch >= 2.12 can), so the packed 4-bit "
            "weights stay whole on every GPU: pass `ignored_params=peft_fastlora.distributed.fsdp2_ignored_params("
            "model)` to `fully_shard` (accelerate 1.15 leaves them out itself). For sharded 4-bit weights on this "
            "torch use FSDP1 with a float `bnb_4bit_quant_storage`.",
            torch.__version__,
        )


def prepare_for_fsdp(model: nn.Module, strict: bool = True, fsdp_version: Optional[int] = None) -> nn.Module:
    """Makes a FastLoRA model shardable by FSDP; call it after ``get_peft_model`` and before FSDP wraps the model.

    FSDP2 (``fully_shard``): re-views every packed 4-bit weight as ``uint8`` so that FSDP2 all-gathers its bytes
    (any ``bnb_4bit_quant_storage`` works; on torch < 2.12 pass [`fsdp2_ignored_params`] to ``fully_shard``), keeps
    the adapters in the ``adapter_dtype`` policy's dtype, and lets FSDP2's mixed precision cast them without FastLoRA
    casting them back (a log line warns when the trainable parameters have several dtypes).

    FSDP1 (``FullyShardedDataParallel``): checks that every 4-bit weight is stored as one float dtype that the other
    frozen float parameters share, and casts the adapters (LoRA weights and every trainable parameter, e.g.
    ``modules_to_save``) to that dtype when the ``adapter_dtype`` policy chose another one (one log line says so).

    Idempotent.

    Under FSDP, fp16 adapters train with FSDP's gradient scaler (``ShardedGradScaler`` for FSDP1, accelerate's for
    FSDP2), which unscales fp16 gradients; torch's plain ``GradScaler`` would refuse them.

    Args:
        model (`nn.Module`): The ``PeftModel`` (or its base model) with FastLoRA layers.
        strict (`bool`, defaults to `True`): Raise [`FSDPConfigError`] for a model FSDP cannot shard; with ``False``
            log the problem and leave the dtypes alone.
        fsdp_version (`int`, *optional*): 1 or 2, the FSDP the model will be wrapped with. Defaults to accelerate's
            ``FSDP_VERSION`` under ``accelerate launch``, else 2 ([`resolve_fsdp_version`]).

    Returns:
        The same model.
    """
    version = resolve_fsdp_version(fsdp_version)
    try:
        _check_shardable_layers(model)
        if version == 1:
            _prepare_fsdp1(model)
        else:
            _prepare_fsdp2(model)
    except FSDPConfigError as err:
        if strict:
            raise
        if is_main_process():
            logger.warning("peft_fastlora: %s", err)
    return model


def fsdp2_ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """What to pass as ``fully_shard(..., ignored_params=...)`` after [`prepare_for_fsdp`]: the packed 4-bit weights
    when this torch cannot shard ``uint8`` parameters with FSDP2 (torch < 2.12), else nothing.

    Ignored weights stay whole on every GPU and are never all-gathered (so never rewritten either).
    """
    if FSDP2_SHARDS_BYTES:
        return set()
    return {m.weight for m in model.modules() if is_quantized_4bit(m) and not m.weight.is_floating_point()}


def fsdp_launched() -> bool:
    """Whether this process was started for FSDP by accelerate (``accelerate launch`` with an FSDP config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def prepare_if_launched(model: nn.Module) -> nn.Module:
    """Runs [`prepare_for_fsdp`] (non-strict, accelerate's ``FSDP_VERSION``) when accelerate launched this process for
    FSDP, and logs that it did; else returns the model unchanged.

    ``FastLoraModel`` calls it after each adapter is added (``peft_fastlora/__init__.py`` installs it as
    ``FastLoraModel.launch_hook``), so a Trainer script under ``accelerate launch`` with an FSDP config needs no extra
    call: the HF Trainer wraps the model before any user callback could prepare it.
    """
    if not fsdp_launched():
        return model
    version = resolve_fsdp_version()
    if is_main_process():
        logger.info(
            "peft_fastlora: accelerate launched this process for FSDP%d (ACCELERATE_USE_FSDP): running "
            "peft_fastlora.distributed.prepare_for_fsdp(model, strict=False, fsdp_version=%d).", version, version,
        )
    return prepare_for_fsdp(model, strict=False, fsdp_version=version)
