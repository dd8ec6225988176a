"""FastLoRA under ``torch.distributed``: DDP needs nothing from here; FSDP needs [`prepare_for_fsdp`].

This package sits above the tuner (``layer``, ``bnb``, ``model``): it may import them, they never import it.

- ``prepare.py``: the FSDP version, FSDP1 / FSDP2 preparation, and [`prepare_if_launched`] (what ``FastLoraModel``
  runs under ``accelerate launch`` with an FSDP config).
- ``saving.py``: [`save_adapter`] for wrapped models, and the two FSDP1 fixes of PEFT's save that
  ``peft_fastlora/__init__.py`` hands to ``_registry``.
"""

from .prepare import (
    DEFAULT_FSDP_VERSION,
    FSDP2_SHARDS_BYTES,
    FSDPConfigError,
    fsdp2_ignored_params,
    fsdp_launched,
    prepare_for_fsdp,
    prepare_if_launched,
    resolve_fsdp_version,
)
from .saving import clean_wrapper_name, fsdp1_module_state_from, save_adapter, unwrap

__all__ = [
    "DEFAULT_FSDP_VERSION",
    "FSDP2_SHARDS_BYTES",
    "FSDPConfigError",
    "clean_wrapper_name",
    "fsdp1_module_state_from",
    "fsdp2_ignored_params",
    "fsdp_launched",
    "prepare_for_fsdp",
    "prepare_if_launched",
    "resolve_fsdp_version",
    "save_adapter",
    "unwrap",
]
