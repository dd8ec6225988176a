"""``fast_norms.py``: which norms take ``ops.rms_norm`` (Liger's "llama" patch, recognised as Liger patches them),
when (training forwards only), idempotence, and the same outputs and gradients as the forward it replaced. Liger is
not installed on CPU machines: a stand-in patches the norms the way Liger's ``_patch_rms_norm_module`` does (its
attributes and a bound ``LigerRMSNorm.forward``); the GPU tests of the fast path run the real one."""

from __future__ import annotations

from types import MethodType

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_fastlora.fast_norms import apply_rms_norms
from peft_fastlora.ops import FORCE_TRITON_ENV
from peft_fastlora.ops.reference import rms_norm_ref


class LigerRMSNorm(torch.nn.Module):  # the stand-in: its forward's qualified name is Liger's
    def forward(self, hidden_states):
        return rms_norm_ref(hidden_states, self.weight, self.variance_epsilon, self.offset)


def _patched(width=32, casting_mode="llama", offset=0.0):
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    norm.requires_grad_(False)  # LoRA freezes the norms
    norm.offset, norm.casting_mode, norm.variance_epsilon, norm.in_place = offset, casting_mode, 1e-5, True
    norm.forward = MethodType(LigerRMSNorm.forward, norm)
    return norm


def test_llama_cast_liger_norms_are_routed_once():
    model = torch.nn.ModuleDict({"a": _patched(), "b": _patched(offset=1.0), "gemma": _patched(casting_mode="gemma"),
                                 "plain": LlamaRMSNorm(32)})  # fmt: skip
    assert apply_rms_norms(model) == 2
    assert apply_rms_norms(model) == 2  # a second call counts them again, wraps nothing twice
    assert type(model["a"].forward).__name__ == "InstanceForward"
    assert model["a"].forward.__wrapped__.__func__ is LigerRMSNorm.forward
    assert isinstance(model["gemma"].forward, MethodType) and "forward" not in model["plain"].__dict__


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_training_forwards_take_the_op_and_agree_with_the_replaced_forward(monkeypatch, offset):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)  # CPU tensors: the op's torch twin
    norm = _patched(offset=offset)
    replaced = norm.forward
    apply_rms_norms(norm)
    x = (torch.randn(3, 5, 32) * 2).to(torch.bfloat16)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = norm(x_ours)
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward"
    expected = rms_norm_ref(x, norm.weight, 1e-5, offset)
    torch.testing.assert_close(y.detach(), expected, atol=0, rtol=0)
    grad = torch.randn_like(x)
    y.backward(grad)
    # the stand-in's forward differentiated by autograd (bf16 intermediates): within bf16 rounding of ours
    replaced(x_theirs).backward(grad)
    scale = x_theirs.grad.float().abs().max().item()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=6e-2 * scale, rtol=6e-2)
    assert norm.weight.grad is None


def test_inference_and_frozen_inputs_keep_the_replaced_forward():
    norm = _patched()
    apply_rms_norms(norm)
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert norm(x.requires_grad_()).grad_fn is None
    assert norm(torch.randn(2, 32)).grad_fn is None  # an input with no grad (the first block, frozen embeddings)
