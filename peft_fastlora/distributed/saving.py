"""Saving a FastLoRA adapter from a DDP- or FSDP-wrapped model, and the two FSDP1 fixes of PEFT's save.

- [`save_adapter`]: every rank calls it; only the adapter tensors are gathered (FSDP2 ``DTensor.full_tensor``), never
  the 4-bit base weights; rank 0 writes what a single-process ``save_pretrained`` writes.
- [`clean_wrapper_name`]: PEFT selects adapter keys by module names, and FSDP1 nesting puts wrapper segments inside
  them; ``_registry.hook_adapter_state_dict`` matches names through it.
- [`fsdp1_module_state_from`]: the HF Trainer saves under FSDP1 on the main process only, while PEFT asks every
  ``modules_to_save`` unit for its ``state_dict()`` (a collective); the context answers from the gathered dict.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Union

import torch
from peft import PeftModel
from torch import nn

from .. import _registry
from .prepare import is_main_process

# Module-name segments that FSDP1 (nested units) and activation-checkpoint wrappers put inside module names.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_wrapper_name(name: str) -> str:
    """``name`` (a module name or state-dict key) without FSDP1 / checkpoint-wrapper segments."""
    for seg in WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def unwrap(model: nn.Module) -> nn.Module:
    """The ``PeftModel`` inside DDP / accelerate wrappers (some forward attribute reads to it, so check the type)."""
    while not isinstance(model, PeftModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _adapter_keys(peft_model: nn.Module, state_dict: dict) -> list[str]:
    """Keys of ``state_dict`` that PEFT saves: the tuner's prefix (``lora_``) and ``modules_to_save`` copies."""
    prefix = getattr(getattr(peft_model, "base_model", None), "prefix", "lora_")
    wrapper_type = _registry.auxiliary_training_wrapper()
    wrappers = [n for n, m in peft_model.named_modules() if isinstance(m, wrapper_type)]
    return sorted(k for k in state_dict if prefix in k or any(k.startswith(w + ".") for w in wrappers))


def save_adapter(model: nn.Module, output_dir: Union[str, os.PathLike], **save_kwargs) -> None:
    """Saves the adapter of a plain, DDP- or FSDP2-wrapped PEFT model like a single-GPU ``save_pretrained``.

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
            "`save_adapter` supports plain, DDP and FSDP2 (`fully_shard`) models, not FSDP1 "
            "(`FullyShardedDataParallel`). Train with FSDP2 (`fully_shard`, accelerate `fsdp_version: 2`) or DDP; "
            "see docs/distributed.md for what FSDP1 saves."
        )
    peft_model = unwrap(model)
    state_dict = peft_model.state_dict()
    full = {}
    for key in _adapter_keys(peft_model, state_dict):
        value = state_dict[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank walks the same sorted keys
        full[key] = value.detach().cpu()
    if is_main_process():
        peft_model.save_pretrained(Path(output_dir), state_dict=full, **save_kwargs)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def fsdp1_module_state_from(peft_model: nn.Module, state_dict: dict):
    """While saving ``peft_model`` with a gathered ``state_dict``, every FSDP1 unit inside a ``modules_to_save``
    wrapper answers ``state_dict()`` with its slice of ``state_dict`` instead of all-gathering its shard.

    PEFT reads ``modules_to_save[adapter].state_dict()`` for the key names; for an FSDP1 unit (PEFT's
    ``fsdp_auto_wrap_policy`` makes one of every trainable leaf) that is a collective, but the HF Trainer calls
    ``save_pretrained`` on the main process only, where a collective would wait for ranks that never join.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapper_type = _registry.modules_to_save_wrapper()
    patched = []
    for name, wrapper in peft_model.named_modules():
        if not isinstance(wrapper, wrapper_type):
            continue
        for adapter, unit in wrapper.modules_to_save.items():
            if isinstance(unit, FullyShardedDataParallel):
                prefix = f"{clean_wrapper_name(name)}.modules_to_save.{adapter}."
                part = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
                unit.state_dict = functools.partial(dict, part)  # an instance attribute shadows the method
                patched.append(unit)
    try:
        yield
    finally:
        for unit in patched:
            del unit.state_dict
