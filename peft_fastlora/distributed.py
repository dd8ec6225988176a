"""FastLoRA under ``torch.distributed``: DDP needs nothing from here; FSDP needs one dtype rule and the quant_state.

DDP (``torchrun``, ``accelerate launch --multi_gpu``, the HF Trainer) works as is: FastLoRA layers are ordinary modules
whose adapters get a gradient on every step, so ``find_unused_parameters=False``, gradient checkpointing and
``modules_to_save`` all work.

FSDP (``torch.distributed.fsdp.fully_shard`` and accelerate's FSDP plugin) shards parameters, which for QLoRA means:

1. The packed 4-bit weights must be stored as a float dtype equal to the model dtype
   (``BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16)`` with ``dtype=torch.bfloat16``): FSDP1 flattens all
   parameters of a unit into one tensor of one dtype, and FSDP mixed precision casts float parameters to its
   ``param_dtype`` (the HF Trainer sets it to ``bnb_4bit_quant_storage``), which would scramble bytes stored as
   another float dtype.
2. The trainable parameters of one FSDP unit must share one dtype, and under mixed precision they are computed in
   ``param_dtype`` anyway. So under FSDP the adapters take the storage dtype instead of the ``adapter_dtype`` policy's;
   [`prepare_for_fsdp`] does this and logs one line when it changes anything.
3. FSDP replaces each ``Params4bit`` by a plain all-gathered tensor, which has no ``quant_state``; bitsandbytes keeps
   the state on the module (``Linear4bit.quant_state``) and [`restore_quant_state`] puts it back before a FastLoRA
   layer reads ``weight.data`` in its forward (after FSDP's all-gather).
4. PEFT's ``fsdp_auto_wrap_policy`` (installed by the HF Trainer for PEFT models under FSDP1) makes every
   ``lora_A`` / ``lora_B`` a unit of its own, whose weight is gathered only inside that module's forward; a FastLoRA
   layer must then call those modules rather than read their weights ([`fsdp_wraps_adapters`]).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Union

import torch
from torch import nn

from .dtypes import override_adapter_dtype

logger = logging.getLogger(__name__)

FLOAT_STORAGE = (torch.float16, torch.bfloat16, torch.float32)
_HOOK_MARK = "_peft_fastlora_fsdp_hook"
STORAGE_FIX = (
    "Load the model with a float `bnb_4bit_quant_storage` equal to its dtype, e.g. "
    "`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16, ...)` and `dtype=torch.bfloat16`. "
    "Under FSDP the adapters then take that dtype too, whatever `adapter_dtype` says."
)


class FSDPConfigError(ValueError):
    """Raised by [`prepare_for_fsdp`] for a model that FSDP cannot shard correctly."""


def _is_main_process() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def restore_quant_state(base_layer: nn.Module) -> None:
    """Re-attaches ``quant_state`` to the weight of a bitsandbytes ``Linear4bit`` that FSDP replaced by a plain tensor.

    A no-op when the weight still has its state (no FSDP, or a ``Params4bit``). Raises if FSDP mixed precision cast
    the packed bytes to another dtype, which makes them unreadable.

    Args:
        base_layer (`nn.Module`): A ``bitsandbytes.nn.Linear4bit``.
    """
    weight = base_layer.weight
    if getattr(weight, "quant_state", None) is not None:
        return
    state = getattr(base_layer, "quant_state", None)
    if state is None:
        return  # never quantized; `packed4bit_from_bnb` raises the error that explains it
    storage = getattr(base_layer, "quant_storage", weight.dtype)
    if weight.dtype != storage:
        raise RuntimeError(
            f"The packed 4-bit weight of this layer is {weight.dtype} but was stored as {storage} "
            f"(`bnb_4bit_quant_storage`): FSDP mixed precision cast the packed bytes. Set FSDP's mixed precision "
            f"`param_dtype` to {storage}, or load the model with `bnb_4bit_quant_storage` equal to that `param_dtype`."
        )
    weight.quant_state = state  # a plain attribute on FSDP's unsharded Parameter; the parameter itself stays FSDP's


def _restore_quant_state_hook(layer: nn.Module, args) -> None:
    restore_quant_state(layer.get_base_layer())


def install_quant_state_hooks(model: nn.Module) -> int:
    """Registers (once) a forward pre-hook on every FastLoRA 4-bit layer that calls [`restore_quant_state`].

    Needed only while ``FastLoraLinear4bit.quantized_weight`` does not call [`restore_quant_state`] itself.
    Returns the number of layers hooked.
    """
    from .bnb import FastLoraLinear4bit

    count = 0
    for module in model.modules():
        if isinstance(module, FastLoraLinear4bit) and not getattr(module, _HOOK_MARK, False):
            module.register_forward_pre_hook(_restore_quant_state_hook)
            setattr(module, _HOOK_MARK, True)
            count += 1
    return count


def _storage_dtypes(model: nn.Module) -> dict[torch.dtype, str]:
    """``{packed weight dtype: name of one layer}`` over the FastLoRA 4-bit layers; raises for 8-bit ones."""
    from .bnb import FastLoraLinear4bit, FastLoraLinear8bit

    found: dict[torch.dtype, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, FastLoraLinear8bit):
            raise FSDPConfigError(
                f"FSDP cannot shard bitsandbytes 8-bit weights (layer {name!r}): they are int8 tensors whose row "
                "scales (`SCB`) are attributes that FSDP's all-gathered tensor does not carry. Use 4-bit loading with "
                "a float `bnb_4bit_quant_storage`, or DDP."
            )
        if isinstance(module, FastLoraLinear4bit):
            found.setdefault(module.get_base_layer().weight.dtype, name)
    return found


def _adapter_params(model: nn.Module) -> set[int]:
    """ids of the parameters that take the storage dtype: every trainable one and every LoRA weight (even frozen)."""
    from peft.tuners.lora import LoraLayer

    ids = {id(p) for p in model.parameters() if p.requires_grad}
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                container = getattr(module, attr, None)
                if container is not None:
                    ids.update(id(p) for p in container.parameters())
    return ids


def _adapter_policies(model: nn.Module) -> str:
    configs = getattr(model, "peft_config", None) or {}
    names = sorted({getattr(c, "adapter_dtype", None) for c in configs.values()} - {None})
    return ", ".join(repr(n) for n in names) or "?"


# Found on 2 x H200 (torch 2.11): FSDP2 all-gathers a unit whose parameters share one dtype in that dtype, and its CUDA
# copy-in rewrites NaN bit patterns to the canonical NaN; packed 4-bit bytes stored as bf16/fp16 that happen to read as
# NaN then decode to other weights. FSDP1 and DDP move raw bytes and are not affected.
FSDP2_PACKED_NAN_WARNING = (
    "Known issue: FSDP2 (`fully_shard`, accelerate `fsdp_version: 2`) on CUDA can rewrite packed 4-bit weights stored "
    "as {dtype} (`bnb_4bit_quant_storage`) whose bits read as NaN, silently changing a small fraction of base weights "
    "(0.07% of words for bf16 storage, 1.7% for fp16 in our 2-GPU test). Use FSDP1 (accelerate `fsdp_version: 1`) or "
    "DDP for QLoRA with FastLoRA until this is fixed; see docs/distributed.md."
)


def prepare_for_fsdp(model: nn.Module, strict: bool = True) -> nn.Module:
    """Makes a FastLoRA model shardable by FSDP; call it after ``get_peft_model`` and before FSDP wraps the model.

    Checks that every 4-bit weight is stored as one float dtype (``bnb_4bit_quant_storage``) that the other frozen
    float parameters share, casts the adapters (LoRA weights and every trainable parameter, e.g. ``modules_to_save``)
    to that dtype when the ``adapter_dtype`` policy chose another one (one log line says so; FastLoRA layers then keep
    the new dtype), and installs [`restore_quant_state`] hooks. Idempotent.

    Under FSDP, fp16 adapters train with FSDP's gradient scaler (``ShardedGradScaler`` for FSDP1, accelerate's for
    FSDP2), which unscales fp16 gradients; torch's plain ``GradScaler`` would refuse them.

    Args:
        model (`nn.Module`): The ``PeftModel`` (or its base model) with FastLoRA layers.
        strict (`bool`, defaults to `True`): Raise [`FSDPConfigError`] for a model FSDP cannot shard; with ``False``
            log the problem and leave the dtypes alone.

    Returns:
        The same model.
    """
    try:
        storages = _storage_dtypes(model)
        if not storages:
            install_quant_state_hooks(model)
            return model
        bad = {d: n for d, n in storages.items() if d not in FLOAT_STORAGE}
        if bad:
            dtype, name = next(iter(bad.items()))
            raise FSDPConfigError(
                f"FSDP needs 4-bit weights stored as a float dtype, but `bnb_4bit_quant_storage` is {dtype} (layer "
                f"{name!r}): FSDP cannot flatten them with the other parameters, and accelerate leaves them unsharded "
                f"(a full copy on every GPU). {STORAGE_FIX}"
            )
        if len(storages) > 1:
            raise FSDPConfigError(
                f"FSDP needs one `bnb_4bit_quant_storage` for the whole model, found {sorted(map(str, storages))}. "
                f"{STORAGE_FIX}"
            )
        target = next(iter(storages))
        adapters = _adapter_params(model)
        frozen = [
            (n, p.dtype)
            for n, p in model.named_parameters()
            if id(p) not in adapters and p.is_floating_point() and p.dtype != target
            and type(p).__name__ != "Params4bit"
        ]
        if frozen:
            name, dtype = frozen[0]
            raise FSDPConfigError(
                f"FSDP needs the model's float parameters in the 4-bit storage dtype {target} "
                f"(`bnb_4bit_quant_storage`), but {len(frozen)} frozen parameters are not (e.g. {name!r} is {dtype}). "
                f"Load the model with `dtype={target}` and do not upcast its parameters afterwards (e.g. with "
                "`prepare_model_for_kbit_training`)."
            )
    except FSDPConfigError as err:
        if strict:
            raise
        if _is_main_process():
            logger.warning("peft_fastlora: %s", err)
        install_quant_state_hooks(model)
        return model

    if torch.cuda.is_available() and target in (torch.bfloat16, torch.float16):
        warnings.warn(FSDP2_PACKED_NAN_WARNING.format(dtype=target), stacklevel=2)
    recast = override_adapter_dtype(model, target, adapters)
    before = ", ".join(sorted({str(d) for d in recast}))
    if recast and _is_main_process():
        logger.warning(
            "peft_fastlora: FSDP: cast %d adapter parameters (adapter_dtype=%s gave %s) to %s, the "
            "`bnb_4bit_quant_storage` dtype, because FSDP shards them together with the 4-bit weights.",
            len(recast), _adapter_policies(model), before, target,
        )
    install_quant_state_hooks(model)
    return model


def fsdp_launched() -> bool:
    """Whether this process was started for FSDP by accelerate (``accelerate launch`` with an FSDP config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def maybe_prepare_for_fsdp(model: nn.Module) -> nn.Module:
    """[`prepare_for_fsdp`] (non-strict) when accelerate launched this process for FSDP; else the model unchanged."""
    return prepare_for_fsdp(model, strict=False) if fsdp_launched() else model


def fsdp_wraps_adapters(layer: nn.Module, adapters: list[str]) -> bool:
    """Whether FSDP made ``lora_A`` / ``lora_B`` of ``layer`` units of their own (FSDP1 or FSDP2).

    PEFT's ``fsdp_auto_wrap_policy`` does this, and the HF Trainer installs it for every PEFT model under FSDP. Such
    a unit gathers its weight only inside its own forward, so a FastLoRA layer must then call the adapter modules
    instead of handing their weights to the fused op (which would see the flat shard).
    """
    wrappers = _fsdp_wrapper_types()
    return bool(wrappers) and any(
        isinstance(container[a], wrappers) for a in adapters for container in (layer.lora_A, layer.lora_B)
    )


@functools.cache
def _fsdp_wrapper_types() -> tuple:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FullyShardedDataParallel, FSDPModule)


def _unwrap(model: nn.Module) -> nn.Module:
    """The ``PeftModel`` inside DDP / accelerate wrappers (some forward attribute reads to it, so check the type)."""
    from peft import PeftModel

    while not isinstance(model, PeftModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _adapter_keys(peft_model: nn.Module, state_dict: dict) -> list[str]:
    """Keys of ``state_dict`` that PEFT saves: the tuner's prefix (``lora_``) and ``modules_to_save`` copies."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    prefix = getattr(getattr(peft_model, "base_model", None), "prefix", "lora_")
    wrappers = [n for n, m in peft_model.named_modules() if isinstance(m, AuxiliaryTrainingWrapper)]
    return sorted(k for k in state_dict if prefix in k or any(k.startswith(w + ".") for w in wrappers))


def save_adapter(model: nn.Module, output_dir: Union[str, os.PathLike], **save_kwargs) -> None:
    """Saves the adapter of a plain, DDP- or FSDP-wrapped PEFT model like a single-GPU ``save_pretrained``.

    Every rank must call it (FSDP2 shards are gathered with collectives); only rank 0 writes. Only the adapter
    tensors are gathered, never the 4-bit base weights.

    Args:
        model (`nn.Module`): The ``PeftModel``, possibly wrapped by DDP or sharded by ``fully_shard``.
        output_dir (`str` or `os.PathLike`): Where to write ``adapter_model.safetensors`` and ``adapter_config.json``.
        save_kwargs: Passed to ``PeftModel.save_pretrained``.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            "`save_adapter` supports plain, DDP and FSDP2 (`fully_shard`) models. For FSDP1 use the HF Trainer's "
            "`save_model` (or accelerate's `get_state_dict`) with `fsdp_state_dict_type: FULL_STATE_DICT`."
        )
    peft_model = _unwrap(model)
    state_dict = peft_model.state_dict()
    full = {}
    for key in _adapter_keys(peft_model, state_dict):
        value = state_dict[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank walks the same sorted keys
        full[key] = value.detach().cpu()
    if _is_main_process():
        peft_model.save_pretrained(Path(output_dir), state_dict=full, **save_kwargs)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
