"""The kernels behind FastLoRA layers, reached through one door per op.

- [`fastlora_linear`] and [`dequantize`] (``dispatch.py``) check their arguments once and pick the implementation;
  [`prepare_small_m_call`] / [`prepare_training_call`] prepare a decode / training call that repeats with the same
  shapes;
- ``quant_state.py``: the weight containers the ops take ([`Packed4bit`], [`Int8Rowwise`]);
- ``reference.py``: the pure-torch twins (the CPU path);
- ``lora_linear.py`` and ``custom_ops.py``: the training path's autograd wrapper and the ``torch.library`` ops;
- ``swiglu_lora.py``: [`swiglu_lora_linear`], the MLP down projection fused with its SwiGLU (keeps no ``h``), and
  [`grouped_lora_mlp`], that with gate/up as a projection group whose LoRA terms the SwiGLU kernels add;
- ``lora_mlp.py``: [`lora_mlp`], a whole SwiGLU MLP of three LoRA projections, each LoRA term inside its matmul;
- ``lora_group.py``: [`lora_linear_group`], LoRA projections of one input (q, k, v) as one op;
- ``linear_cross_entropy.py``: [`linear_cross_entropy`], the LM head fused with its loss (no full logits);
- ``rms_norm.py``: [`rms_norm`], RMSNorm whose backward reads each row once (the fast path's norms);
- ``kernels/``: everything that imports Triton.

ops/ never imports peft or bitsandbytes. Caching inside ops/ is documented where it lives: per weight in
``quant_state.memo`` (the only per-weight cache), compiled launchers in ``kernels/launch.py``, tilings and grids in
``kernels/small_m.py``, the tuning table in ``kernels/tuning.py``; each is keyed by everything it reads.
"""

from .dispatch import FORCE_TRITON_ENV, dequantize, fastlora_linear, prepare_small_m_call, prepare_training_call
from .linear_cross_entropy import LinearCrossEntropyFunction, linear_cross_entropy
from .lora_group import LoraGroupFunction, lora_linear_group
from .lora_linear import LoraLinearFunction
from .lora_mlp import LoraGateUpFunction, LoraProjection, SwiGLUDownFunction, lora_mlp, lora_mlp_fusable
from .quant_state import Int8Rowwise, Packed4bit, QuantizedWeight
from .rms_norm import RMSNormFunction, rms_norm
from .swiglu_lora import SwiGLULoraFunction, grouped_lora_mlp, swiglu_lora_linear

__all__ = [
    "FORCE_TRITON_ENV",
    "Int8Rowwise",
    "LinearCrossEntropyFunction",
    "LoraLinearFunction",
    "LoraGateUpFunction",
    "LoraGroupFunction",
    "LoraProjection",
    "Packed4bit",
    "QuantizedWeight",
    "RMSNormFunction",
    "SwiGLUDownFunction",
    "SwiGLULoraFunction",
    "dequantize",
    "fastlora_linear",
    "grouped_lora_mlp",
    "linear_cross_entropy",
    "lora_linear_group",
    "lora_mlp",
    "lora_mlp_fusable",
    "prepare_small_m_call",
    "prepare_training_call",
    "rms_norm",
    "swiglu_lora_linear",
]
