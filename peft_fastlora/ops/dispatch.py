"""The one door to the ops: [`fastlora_linear`] and [`dequantize`] check their arguments once and pick the path.

Dispatch of [`fastlora_linear`]:

- autocast on: ``x`` (and ``lora_x``) are cast to the autocast dtype first, as ``nn.Linear`` would be, and the op runs
  with autocast off;
- tensors not on CUDA: the pure-torch reference (plain autograd), unless ``PEFT_FASTLORA_FORCE_TRITON=1`` (tests run
  the Triton path under the interpreter that way);
- no grad needed and at most as many rows as the measured crossover for this GPU and shape (``kernels/tuning.py``;
  else ``SMALL_M_MAX``): the fused small-M kernel;
- otherwise: ``LoraLinearFunction`` (dequantize + cuBLAS, W not saved for backward).

[`prepare_small_m_call`] and [`prepare_training_call`] check a call once and return it prepared, for a layer that
repeats it with the same shapes (decoding, and training steps at small batch, where the host sets the pace).

Under ``torch.compile`` the Triton paths go through the ``torch.ops.peft_fastlora`` custom ops instead, so that
``fullgraph=True`` holds; eagerly they are called directly, which keeps the per-call overhead to plain Python. Every
path below this module takes checked arguments and checks nothing again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Optional

import torch

from . import custom_ops, kernels
from .lora_linear import LoraLinearFunction
from .quant_state import FLOAT_DTYPES, Int8Rowwise, Packed4bit, QuantizedWeight, memo
from .reference import dequantize_ref, lora_linear_ref

FORCE_TRITON_ENV = "PEFT_FASTLORA_FORCE_TRITON"


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get(FORCE_TRITON_ENV, "0") == "1"


# ---- the argument check ---------------------------------------------------------------------------------------------
def _check_field(t: Optional[torch.Tensor], name: str, device: torch.device, dtype=None, numel=None) -> None:
    """Checks a weight field: present, on ``device``, contiguous, of ``dtype`` and with at least ``numel`` items."""
    if t is None:
        raise ValueError(f"`{name}` is None; rebuild the weight with `packed4bit_from_bnb`.")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device} but the weight data is on {device}; move the whole weight.")
    if not t.is_contiguous():
        raise ValueError(f"`{name}` must be contiguous, got strides {t.stride()}; call `.contiguous()` on it.")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"`{name}` must have dtype {dtype}, got {t.dtype}.")
    if numel is not None and t.numel() < numel:
        raise ValueError(f"`{name}` has {t.numel()} elements but the weight needs at least {numel}.")


def _check_packed4bit(weight: Packed4bit) -> None:
    bs = weight.blocksize
    if bs < 2 or bs & (bs - 1):
        raise ValueError(f"`weight.blocksize` must be a power of two >= 2 (bitsandbytes uses 64..4096), got {bs}.")
    n = weight.numel
    if n <= 0:
        raise ValueError(f"`weight.shape` must be positive, got {weight.shape}.")
    device = weight.data.device
    if not weight.data.is_contiguous():
        raise ValueError(
            f"`weight.data` must be contiguous to be read as packed bytes, got strides {weight.data.stride()}; "
            "call `.contiguous()` on it."
        )
    n_bytes = weight.data.numel() * weight.data.element_size()
    if n_bytes < (n + 1) // 2:
        raise ValueError(f"`weight.data` has {n_bytes} bytes but the weight needs at least {(n + 1) // 2}.")
    n_blocks = (n + bs - 1) // bs
    _check_field(weight.code, "weight.code", device, torch.float32, 16)
    if weight.nested:
        _check_field(weight.absmax, "weight.absmax", device, torch.uint8, n_blocks)
        nbs = weight.nested_blocksize
        if nbs < 1:
            raise ValueError(f"`weight.nested_blocksize` must be >= 1 for a double-quantized weight, got {nbs}.")
        _check_field(weight.nested_code, "weight.nested_code", device, torch.float32, 256)
        _check_field(weight.nested_absmax, "weight.nested_absmax", device, torch.float32, (n_blocks + nbs - 1) // nbs)
        _check_field(weight.offset, "weight.offset", device, torch.float32, 1)
    else:
        _check_field(weight.absmax, "weight.absmax", device, torch.float32, n_blocks)


def _check_int8(weight: Int8Rowwise) -> None:
    if weight.cb.dim() != 2:
        raise ValueError(f"`weight.cb` must be 2-D (out_features, in_features), got shape {tuple(weight.cb.shape)}.")
    _check_field(weight.cb, "weight.cb", weight.cb.device, torch.int8)
    _check_field(weight.scb, "weight.scb", weight.cb.device, torch.float32)
    if weight.scb.numel() != weight.cb.shape[0]:
        raise ValueError(
            f"`weight.scb` must have one scale per row ({weight.cb.shape[0]}), got {weight.scb.numel()} elements."
        )


def check_weight(weight: QuantizedWeight) -> None:
    """Raises a clear error unless ``weight`` is a well-formed [`Packed4bit`] or [`Int8Rowwise`].

    Eagerly the result is memoized on the container (``quant_state.memo``): a layer's container is checked once.
    Under ``torch.compile`` the checks run at trace time only (they read shapes, dtypes and strides).
    """
    if isinstance(weight, Packed4bit):
        check = _check_packed4bit
    elif isinstance(weight, Int8Rowwise):
        check = _check_int8
    else:
        raise TypeError(
            f"`weight` must be a Packed4bit or Int8Rowwise, got {type(weight).__name__}; build one with "
            "`peft_fastlora.bnb.packed4bit_from_bnb` or `int8_from_bnb`."
        )
    if torch.compiler.is_compiling():
        check(weight)
    else:
        memo(weight, ("checked",), lambda: check(weight) or True)


def check_dtype(dtype: torch.dtype, name: str = "dtype") -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"`{name}` must be float16, bfloat16 or float32, got {dtype}; cast to one of them first.")


def check_linear_args(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    lora_x: Optional[torch.Tensor],
) -> None:
    """Raises a clear error for arguments that no path of [`fastlora_linear`] can take."""
    check_weight(weight)
    check_dtype(x.dtype, "x.dtype")
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"`x` must have in_features={k} as its last dim, got shape {tuple(x.shape)}.")
    device = x.device
    if weight.device != device:
        raise ValueError(f"`weight` is on {weight.device} but `x` is on {device}; move the model to one device.")
    for name, t in (("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b), ("lora_x", lora_x)):
        if t is not None and t.device != device:
            raise ValueError(f"`{name}` is on {t.device} but `x` is on {device}; move the model to one device.")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"`bias` must have shape ({n},), got {tuple(bias.shape)}.")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("`lora_a` and `lora_b` must be given together (or both None for no LoRA term).")
    if lora_a is None:
        return
    r = lora_a.shape[0]
    if lora_a.dim() != 2 or lora_a.shape[1] != k or lora_b.shape != (n, r):
        raise ValueError(
            f"`lora_a` must be (r, {k}) and `lora_b` ({n}, r), got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}."
        )
    check_dtype(lora_a.dtype, "lora_a.dtype")
    check_dtype(lora_b.dtype, "lora_b.dtype")
    if lora_x is not None and lora_x.shape != x.shape:
        raise ValueError(f"`lora_x` must have the shape of `x` {tuple(x.shape)}, got {tuple(lora_x.shape)}.")


# ---- dequantize ------------------------------------------------------------------------------------------------------
def dequantize(weight: QuantizedWeight, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantizes a [`Packed4bit`] or [`Int8Rowwise`] weight to ``dtype``: Triton on CUDA, the reference elsewhere.

    Args:
        weight: The quantized weight, shape ``(out_features, in_features)``.
        dtype (`torch.dtype`): Output dtype (fp16, bf16 or fp32).
        out (`torch.Tensor`, *optional*): A contiguous ``weight.shape`` tensor of ``dtype`` on the weight's device to
            write into (e.g. a reused buffer).

    Returns:
        `torch.Tensor`: The dequantized weight (``out`` when given), bit-exact with bitsandbytes' own.
    """
    check_weight(weight)
    check_dtype(dtype)
    if out is not None:
        shape = tuple(weight.shape)
        if tuple(out.shape) != shape or out.dtype != dtype or out.device != weight.device:
            raise ValueError(
                f"`out` must be a {shape} {dtype} tensor on {weight.device}, got {tuple(out.shape)} {out.dtype} on "
                f"{out.device}. Allocate it with `torch.empty(weight.shape, dtype=dtype, device=weight.device)`."
            )
        if not out.is_contiguous():
            raise ValueError(f"`out` must be contiguous, got strides {out.stride()}.")
    if not _use_triton(weight.device):
        result = dequantize_ref(weight, dtype)
        return result if out is None else out.copy_(result)
    if torch.compiler.is_compiling():
        result = custom_ops.dequantize_op(dtype, *weight.to_fields())
        return result if out is None else out.copy_(result)
    return kernels.load().dequant.dequantize_triton(weight, dtype, out)


# ---- fastlora_linear ------------------------------------------------------------------------------------------------
def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _takes_small_m(x, weight, *inputs: Optional[torch.Tensor]) -> bool:
    """The fused small-M kernel's condition: no grad needed for ``x`` and ``inputs``, and at most as many rows as the
    crossover of this GPU and shape. [`fastlora_linear`] and [`prepare_small_m_call`] both decide with it."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return not _needs_grad(x, *inputs) and rows <= kernels.load().small_m.small_m_limit(weight, x.device)


def _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x):
    check_linear_args(x, weight, bias, lora_a, lora_b, lora_x)
    if not _use_triton(x.device):
        return lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    if lora_a is None or lora_x is x:
        lora_x = None  # the LoRA branch reads x; its grad then goes straight into dx
    elif lora_x is not None and lora_x.dtype != x.dtype:
        lora_x = lora_x.to(x.dtype)
    scaling = float(scaling)
    compiling = torch.compiler.is_compiling()
    if _takes_small_m(x, weight, lora_x, lora_a, lora_b, bias):
        if compiling:
            return custom_ops.lora_linear_small_m_op(x, bias, lora_a, lora_b, scaling, lora_x, *weight.to_fields())
        return kernels.load().small_m.small_m_linear(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    if compiling:
        return custom_ops.lora_linear_op(x, bias, lora_a, lora_b, scaling, lora_x, *weight.to_fields())[0]
    return LoraLinearFunction.apply(x, bias, lora_a, lora_b, scaling, lora_x, weight)


def fastlora_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T) @ B.T`` with ``y.dtype == x.dtype``.

    Same signature and semantics as [`~peft_fastlora.ops.reference.lora_linear_ref`]; picks the implementation
    (see the module docstring). Grads of fp32 adapters used with fp16/bf16 activations come back in fp32.

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32; W is dequantized to this dtype.
        weight: The quantized base weight ``(out_features, in_features)``, on ``x``'s device.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``.
        lora_a (`torch.Tensor`, *optional*): ``(r, in_features)``; with ``lora_b`` ``(out_features, r)``. ``None``
            skips the LoRA term.
        scaling (`float`): LoRA scaling (``alpha / r``).
        lora_x (`torch.Tensor`, *optional*): Input of the LoRA branch (e.g. after dropout); defaults to ``x``.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return _dispatch(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    dtype = torch.get_autocast_dtype(device_type)
    if lora_x is x:
        lora_x = None  # before x is cast: the LoRA branch keeps reading x
    elif lora_x is not None and lora_x.dtype != dtype:
        lora_x = lora_x.to(dtype)
    if x.dtype != dtype:
        x = x.to(dtype)
    return without_autocast(device_type, _dispatch, x, weight, bias, lora_a, lora_b, scaling, lora_x)


def prepare_small_m_call(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
) -> Optional[Callable[[torch.Tensor, float], torch.Tensor]]:
    """A prepared ``fastlora_linear(x, weight, bias, lora_a, lora_b, scaling)`` for no-grad calls on inputs of ``x``'s
    shape, dtype and device, when [`fastlora_linear`] would run that call with the fused small-M kernel; else None.

    Returns ``run(x, scaling)``. Decoding calls each layer with the same shapes on every token; the prepared call
    skips the checks, the tiling lookup and the argument building that [`fastlora_linear`] repeats per call. The
    caller keeps it only while ``weight``, ``bias``, ``lora_a`` and ``lora_b`` are the tensors it was prepared with
    (their values may change in place) and calls it only where [`fastlora_linear`] would take the same path: grad
    off, autocast off or in ``x``'s dtype, not under ``torch.compile``.
    """
    if not _preparable(x, weight, bias, lora_a, lora_b) or not _takes_small_m(x, weight, lora_a, lora_b, bias):
        return None
    return kernels.load().small_m.prepare_small_m_linear(x, weight, bias, lora_a, lora_b)


def _preparable(x, weight, bias, lora_a, lora_b) -> bool:
    """What both prepared calls need (after checking the arguments): the Triton path, not compiling, and autocast
    off or in ``x``'s dtype (the general path casts ``x`` first)."""
    if not _use_triton(x.device):
        return False
    check_linear_args(x, weight, bias, lora_a, lora_b, None)
    device_type = x.device.type
    autocast_elsewhere = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != x.dtype
    return not (torch.compiler.is_compiling() or autocast_elsewhere)


def prepare_training_call(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
) -> Optional[Callable[[torch.Tensor, float], torch.Tensor]]:
    """A prepared ``fastlora_linear(x, weight, bias, lora_a, lora_b, scaling)`` for calls with grad mode on, on inputs
    of ``x``'s shape, dtype and device, when the adapters (or the bias) train, so that [`fastlora_linear`] would run
    the call as ``LoraLinearFunction`` whatever the rows; else None.

    Returns ``run(x, scaling)``. A training step calls each layer with the same shapes on every step (twice under
    gradient checkpointing), and at batch 1 it waits on the host: the prepared call skips the checks and the path
    choice that [`fastlora_linear`] repeats per call. The caller keeps it only while ``weight``, ``bias``,
    ``lora_a`` and ``lora_b`` are the tensors it was prepared with and still require grad as they did (their values
    may change in place), and calls it only with grad mode on, autocast off or in ``x``'s dtype, not under
    ``torch.compile``, with the LoRA branch reading ``x`` itself.
    """
    if not _preparable(x, weight, bias, lora_a, lora_b) or not _needs_grad(lora_a, lora_b, bias):
        return None
    device_type = x.device.type
    apply = LoraLinearFunction.apply

    def run(x: torch.Tensor, scaling: float) -> torch.Tensor:
        if torch.is_autocast_enabled(device_type):  # in x's dtype: fastlora_linear would turn it off, so do the same
            return without_autocast(device_type, apply, x, bias, lora_a, lora_b, float(scaling), None, weight)
        return apply(x, bias, lora_a, lora_b, float(scaling), None, weight)

    return run


def without_autocast(device_type: str, fn, *args):
    """``fn(*args)`` with autocast off for ``device_type`` (it is on when this is called)."""
    if torch.compiler.is_compiling():
        with torch.autocast(device_type, enabled=False):
            return fn(*args)
    # Eagerly, flip the flag instead of entering `torch.autocast(enabled=False)`: its constructor alone costs more host
    # time than a kernel launch, on every layer of every step.
    torch.set_autocast_enabled(device_type, False)
    try:
        return fn(*args)
    finally:
        torch.set_autocast_enabled(device_type, True)
