"""Silences the known third-party output that says nothing about an example's run, each line by its exact text.

Import it and call ``quiet_third_party()`` before importing torch, transformers or bitsandbytes: bitsandbytes' CPU
backend logs its line at import time. Anything else, warnings included, still shows.
"""

from __future__ import annotations

import logging
import warnings


def _not_kernels_community(record: logging.LogRecord) -> bool:
    # bitsandbytes' optional CPU kernel for its own 4-bit matmul, which FastLoRA never calls (docs/versions.md).
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


def quiet_third_party() -> None:
    """Drops bitsandbytes' "kernels-community" log line and transformers' ``is_gradient_checkpointing`` deprecation
    warning (raised inside PEFT's ``get_peft_model``); idempotent."""
    bnb_logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if _not_kernels_community not in bnb_logger.filters:
        bnb_logger.addFilter(_not_kernels_community)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def hide_loading_bars() -> None:
    """Hides transformers' per-file "Loading weights" / "Writing model shards" bars (tiny models load instantly)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
