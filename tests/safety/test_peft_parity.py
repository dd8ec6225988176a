"""FastLoRA trains like stock PEFT LoRA: same base, same seed, same adapter init, same data -> same losses.

Tolerances (max |loss difference| over 20 AdamW steps at lr 1e-2, losses ~4.9 -> ~3.9):

- fp32 compute: 1e-4. Both compute ``x @ dequant(W).T + scaling * (x @ A.T) @ B.T`` in fp32 from bit-identical
  dequantized weights; only the summation order of the matmuls may differ (~1e-7 per op).
- fp16 / bf16 compute: 1e-2 / 3e-2. The base term is the same; the LoRA term is rounded differently -- stock PEFT
  computes it in fp32, rounds it to the activation dtype and then rounds the sum; FastLoRA sums in fp32 and rounds
  once -- so steps differ by the dtype's rounding (fp16 2^-11, bf16 2^-8) of a small term, which Adam at lr 1e-2 can
  amplify for a step or two: on an H100 the bf16 4-bit run differs by 2.14e-2 at one step (the sixth; at most 1.13e-2 at
  every other) since the LoRA add is a Triton pass (``kernels/lowrank.py``: the same one rounding as cuBLAS' ``addmm_``,
  another summation order), and by under 2e-2 with ``addmm_``.
- 8-bit on CUDA: 5e-2. bitsandbytes' int8 matmul quantizes the activations too (LLM.int8()); FastLoRA dequantizes
  the weight and keeps the activations, so the base term itself differs by int8 rounding of x.

For scale: multiplying FastLoRA's LoRA scaling by 1.25 moves the losses by ~0.07 within those 20 steps, so these
tolerances catch a wrong scaling, a missing dropout, or gradients of the wrong adapter. On CPU both run on the
reference path and agree exactly. The model has intermediate_size=128 because bitsandbytes' native CPU dequantize is
wrong when in_features is not a multiple of 64, which would make stock PEFT the wrong one.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import CUDA
from .helpers import copy_adapters, fastlora, load, stock_lora, token_batch, train_steps

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

STEPS = 20
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
INT8_CUDA_TOL = 5e-2


def _losses(model, ids) -> torch.Tensor:
    return torch.tensor(train_steps(model, ids, STEPS, lr=1e-2))


@pytest.mark.parametrize("bits", [4, 8], ids=["4bit", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_losses_match_stock_peft(parity_llama_path, device, bits, dtype):
    kwargs = dict(compute_dtype=dtype) if bits == 4 else {}
    fast = fastlora(load(parity_llama_path, dtype, device, bits=bits, **kwargs), adapter_dtype="fp32")
    stock = stock_lora(load(parity_llama_path, dtype, device, bits=bits, **kwargs))
    copy_adapters(fast, stock)  # stock PEFT also keeps fp32 adapters (autocast_adapter_dtype=True)
    ids = token_batch(batch=4, device=device)
    fast_losses, stock_losses = _losses(fast, ids), _losses(stock, ids)
    assert torch.isfinite(fast_losses).all() and torch.isfinite(stock_losses).all()
    assert fast_losses[-5:].mean() < fast_losses[0] - 0.3  # both actually trained
    tol = INT8_CUDA_TOL if bits == 8 and device == CUDA else TOL[dtype]
    diff = (fast_losses - stock_losses).abs().max().item()
    assert diff < tol, f"max |loss difference| {diff:.2e} >= {tol:.0e}\nfastlora {fast_losses}\nstock {stock_losses}"
