"""Pure-torch twins of every Triton op: the CPU path, and what the kernels are compared with.

Each function has the same signature as its kernel counterpart. Math is done in fp32 and rounded once to the
requested dtype, which is what bitsandbytes' own dequantization does, so these results are bit-exact with it.

This is a production path (every CPU forward dequantizes through it), so it is written for speed: table lookups
through ``index_select`` with int32 indices and per-block scales applied by broadcasting over a
``(n_blocks, blocksize)`` view, never a per-element index tensor or a repeated scale. The tests check it against a
separate, literal oracle (``tests/ops/helpers.py``) and against bitsandbytes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .quant_state import INT8_INV_127, Int8Rowwise, Packed4bit, QuantizedWeight


def _scale_blocks_(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``values[i] * scales[i // blocksize]`` in fp32 for a flat fp32 ``values`` of any length, in place when the
    length is a whole number of blocks (``values`` is always a temporary of the caller's)."""
    n = values.numel()
    n_blocks = -(-n // blocksize)
    if n_blocks * blocksize != n:
        values = F.pad(values, (0, n_blocks * blocksize - n))
    # ``scales`` may come in any shape (bitsandbytes' CPU packing stores absmax 2-D): read it flat.
    return values.view(n_blocks, blocksize).mul_(scales.float().reshape(-1)[:n_blocks, None]).view(-1)[:n]


def decode_absmax(weight: Packed4bit) -> torch.Tensor:
    """Returns the fp32 per-block scales, decoding the double-quantized absmax when present."""
    if not weight.nested:
        return weight.absmax.float()
    codes = weight.nested_code.float().index_select(0, weight.absmax.reshape(-1).int())
    # Multiply, then add: two roundings, like bitsandbytes (a fused multiply-add would change the last bit).
    return _scale_blocks_(codes, weight.nested_absmax, weight.nested_blocksize).add_(weight.offset.float())


def _byte_table(code: torch.Tensor) -> torch.Tensor:
    """(256, 2) fp32: the values of a packed byte's high and low nibble, so one lookup decodes two elements."""
    byte = torch.arange(256, device=code.device)
    code = code.float()
    return torch.stack([code[byte >> 4], code[byte & 0xF]], dim=1)


def dequantize_4bit_ref(weight: Packed4bit, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes a 4-bit weight to ``dtype`` (shape ``weight.shape``), math in fp32 with one final rounding."""
    n = weight.numel
    packed = weight.data.contiguous().reshape(-1).view(torch.uint8)[: (n + 1) // 2]
    values = _byte_table(weight.code).index_select(0, packed.int()).view(-1)[:n]
    return _scale_blocks_(values, decode_absmax(weight), weight.blocksize).view(weight.shape).to(dtype)


def dequantize_int8_ref(weight: Int8Rowwise, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes a row-scaled int8 weight: ``cb * scb[:, None] / 127`` in fp32, rounded once to ``dtype``."""
    return (weight.cb.float() * weight.scb.float().view(-1, 1) * INT8_INV_127).to(dtype)


def dequantize_ref(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Dequantizes either kind of quantized weight to ``dtype``."""
    if isinstance(weight, Int8Rowwise):
        return dequantize_int8_ref(weight, dtype)
    return dequantize_4bit_ref(weight, dtype)


def dequantize_window_ref(
    weight: QuantizedWeight, dtype: torch.dtype, rows: tuple[int, int], columns: tuple[int, int]
) -> torch.Tensor:
    """Rows x columns of the dequantized weight, contiguous (the twin of ``dequantize_window``; the kernel checks the
    window, this one slices whatever it is given)."""
    return dequantize_ref(weight, dtype)[rows[0] : rows[1], columns[0] : columns[1]].contiguous()


def lora_linear_ref(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T @ B.T)`` with ``y.dtype == x.dtype``.

    Args:
        x (`torch.Tensor`): Activations ``(..., in_features)`` in fp16, bf16 or fp32; W is dequantized to this dtype.
        weight: The quantized base weight ``(out_features, in_features)``.
        bias (`torch.Tensor`, *optional*): ``(out_features,)``, cast to ``x.dtype``.
        lora_a (`torch.Tensor`, *optional*): ``(r, in_features)``; with ``lora_b`` ``(out_features, r)``. The LoRA
            term is computed in the adapter dtype and cast to ``x.dtype``. ``None`` skips it.
        scaling (`float`): LoRA scaling (``alpha / r``).
        lora_x (`torch.Tensor`, *optional*): Input of the LoRA branch (e.g. after dropout); defaults to ``x``.
    """
    w = dequantize_ref(weight, x.dtype)
    out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
    if lora_a is not None:
        lx = x if lora_x is None else lora_x
        lora = F.linear(F.linear(lx.to(lora_a.dtype), lora_a), lora_b.to(lora_a.dtype)) * scaling
        out = out + lora.to(x.dtype)
    return out


def lowrank_add_ref(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``out += scaling * a @ b.T`` in place, fp32 math with one rounding to ``out.dtype`` (twin of
    ``kernels.lowrank.lowrank_add_``); returns ``out``."""
    return out.copy_(torch.addmm(out.float(), a.float(), b.float().t(), alpha=scaling))


def _with_term(x: torch.Tensor, term: Optional[tuple], name: str) -> torch.Tensor:
    """``x`` as the SwiGLU twins see it with its pending term ``(a, b, scaling)`` (the ``gate_term`` / ``up_term`` /
    ``grad_h_term`` of ``kernels.swiglu``): ``lowrank_add_ref`` on a copy of ``x`` viewed 2-D, back in ``x``'s shape;
    ``x`` itself without a term. (The kernels also take no rank past ``lowrank.MAX_RANK``.)"""
    if term is None:
        return x
    a, b, scaling = term
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    shapes_match = a.dim() == 2 and a.shape[0] == rows.shape[0] and tuple(b.shape) == (rows.shape[1], a.shape[1])
    if not shapes_match or not a.dtype == b.dtype == x.dtype:
        raise ValueError(f"`{name}` must be (a, b, scaling) with a ({rows.shape[0]}, r) and b ({rows.shape[1]}, r) "
                         f"of {x.dtype}; got a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")  # fmt: skip
    return lowrank_add_ref(rows.clone(), a, b, scaling).reshape(x.shape)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 gate_term: Optional[tuple] = None, up_term: Optional[tuple] = None) -> torch.Tensor:  # fmt: skip
    """``silu(gate) * up`` in ``gate.dtype``, math in fp32 with one rounding, into ``out`` when given (twin of
    ``kernels.swiglu.silu_mul``; gate and up with their pending terms, if any: [`_with_term`])."""
    g = _with_term(gate, gate_term, "gate_term").float()
    h = (g * torch.sigmoid(g) * _with_term(up, up_term, "up_term").float()).to(gate.dtype)
    return h if out is None else out.copy_(h)


def silu_mul_backward_ref(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    grad_h_is_scratch: bool = False,
    out_up: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of [`silu_mul_ref`], fp32 math, one rounding each (twin of
    ``kernels.swiglu.silu_mul_backward``; ``grad_h_is_scratch``: d gate is written into ``grad_h``; ``out_up``: d up
    is written there)."""
    dh, g, u = grad_h.float(), gate.float(), up.float()
    sig = torch.sigmoid(g)
    dg, du = (dh * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (dh * g * sig).to(up.dtype)
    if grad_h_is_scratch and grad_h.dtype == gate.dtype:
        dg = grad_h.copy_(dg)
    if out_up is not None:
        du = out_up.copy_(du)
    return dg, du


def silu_mul_t_matmul_ref(t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, gate_term: Optional[tuple] = None,
                          up_term: Optional[tuple] = None) -> torch.Tensor:  # fmt: skip
    """``t.T @ silu_mul_ref(gate, up)`` in fp32 (``h`` rounded to ``gate.dtype`` first; twin of
    ``kernels.swiglu.silu_mul_t_matmul``; gate and up with their pending terms, if any)."""
    rows = _with_term(gate, gate_term, "gate_term").reshape(-1, gate.shape[-1])
    up = _with_term(up, up_term, "up_term").reshape(rows.shape)
    return t.reshape(rows.shape[0], t.shape[-1]).float().t() @ silu_mul_ref(rows, up).float()


def silu_mul_backward_lora_ref(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    t: torch.Tensor,
    *,
    grad_h_is_scratch: bool = False,
    out_up: Optional[torch.Tensor] = None,
    gate_term: Optional[tuple] = None,
    up_term: Optional[tuple] = None,
    grad_h_term: Optional[tuple] = None,
    term_b_grads: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(d gate, d up, t.T @ h)``: [`silu_mul_backward_ref`] and [`silu_mul_t_matmul_ref`] (twin of
    ``kernels.swiglu.silu_mul_backward_lora``; the operands with their pending terms, if any). ``term_b_grads``: also
    ``a_gate.T @ d gate`` and ``a_up.T @ d up`` in fp32 (the gate and up terms' ``a``)."""
    if term_b_grads and (gate_term is None or up_term is None):
        raise ValueError("`term_b_grads=True` needs both `gate_term` and `up_term`.")
    gate, up = _with_term(gate, gate_term, "gate_term"), _with_term(up, up_term, "up_term")
    dh = _with_term(grad_h, grad_h_term, "grad_h_term")
    grad_a = silu_mul_t_matmul_ref(t, gate, up)
    dg, du = silu_mul_backward_ref(dh, gate, up, grad_h_is_scratch=grad_h_is_scratch, out_up=out_up)
    if grad_h_is_scratch and dh is not grad_h and grad_h.dtype == gate.dtype:
        dg = grad_h.copy_(dg)  # over grad_h itself, not over its copy with the term
    if not term_b_grads:
        return dg, du, grad_a
    b_grads = tuple(term[0].float().t() @ grad.reshape(term[0].shape[0], grad.shape[-1]).float()
                    for term, grad in ((gate_term, dg), (up_term, du)))  # fmt: skip
    return dg, du, grad_a, *b_grads


def cross_entropy_grad_ref(logits: torch.Tensor, target: torch.Tensor, grad_scale: float,
                           ignore_index: int) -> torch.Tensor:  # fmt: skip
    """Per-row fp32 cross-entropy of ``logits`` ``(rows, V)`` against ``target``; overwrites the logits with
    ``grad_scale * (softmax - onehot)``, rounded once (zero where the target is ``ignore_index``). Twin of
    ``kernels.cross_entropy.cross_entropy_grad_``."""
    x = logits.float()
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=1)
    loss = torch.where(valid, lse - x.gather(1, safe).squeeze(1), 0.0)
    grad = torch.exp(x - lse.unsqueeze(1))
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    grad.mul_(torch.where(valid, grad_scale, 0.0).unsqueeze(1))
    logits.copy_(grad)
    return loss


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim in ``x.dtype``: ``x * rstd`` in fp32 rounded to ``x.dtype``, then times
    ``weight + offset`` in fp32 with one more rounding (twin of ``kernels.rms_norm.rms_norm_forward``)."""
    normed = (x.float() * _rstd(x, eps)).to(x.dtype)
    return (normed.float() * (weight.float() + offset)).to(x.dtype)


def rms_norm_backward_ref(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                          offset: float = 0.0) -> torch.Tensor:  # fmt: skip
    """``dx`` of [`rms_norm_ref`] in ``x.dtype``, fp32 math: ``rstd * m - rstd^3 / n * sum(m * x) * x`` with
    ``m = grad * (weight + offset)`` (twin of ``kernels.rms_norm.rms_norm_backward``)."""
    x32, rstd = x.float(), _rstd(x, eps)
    m = grad.float() * (weight.float() + offset)
    dx = rstd * m - rstd.pow(3) / x.shape[-1] * (m * x32).sum(-1, keepdim=True) * x32
    return dx.to(x.dtype)
