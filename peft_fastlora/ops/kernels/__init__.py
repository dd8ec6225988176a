"""Everything in ops/ that imports Triton lives in this package; importing the package itself does not.

- ``launch.py``: the low-overhead launch helper and grid utilities;
- ``jit.py``: ``@triton.jit`` helpers shared by the kernels (format decoding, rounding);
- ``dequant.py``: the dequant kernels and their launchers;
- ``small_m_kernel.py`` / ``small_m_lora.py`` / ``small_m.py``: the fused small-M (decode) kernel, its LoRA half
  (``xa`` in chunks, the epilogue) and its launcher;
- ``swiglu.py``: ``silu(gate) * up`` and its backward (the fused MLP down projection's elementwise half);
- ``lowrank.py``: ``out += scaling * a @ b.T`` in place (LoRA's term added into an output or an input grad);
- ``cross_entropy.py``: cross-entropy of a chunk of logits, its gradient written over them (the fused loss's half);
- ``rms_norm.py``: RMSNorm of rows and its input gradient, one program per row (the fast path's norms);
- ``tuning.py``: the small-M tuning table (no Triton).

The rest of ops/ reaches the kernels only through [`load`], so that ``import peft_fastlora`` works where Triton is
absent (CPU-only installs use the pure-torch reference).
"""

from __future__ import annotations

import sys
from types import ModuleType

# Set by the first [`load`]. A flag rather than a functools cache: torch.compile traces the dispatcher's calls of
# `load`, and dynamo warns about (and ignores) every functools cache it meets; a module global it reads and guards.
_loaded = False


def load() -> ModuleType:
    """Imports the kernels on first use and returns this package, with ``dequant``, ``small_m``, ``swiglu``,
    ``lowrank``, ``cross_entropy`` and ``rms_norm`` loaded."""
    global _loaded
    if not _loaded:
        from . import cross_entropy, dequant, lowrank, rms_norm, small_m, swiglu  # noqa: F401

        _loaded = True
    return sys.modules[__name__]
