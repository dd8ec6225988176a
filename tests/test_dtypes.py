import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from peft_fastlora.dtypes import layer_compute_dtype, resolve_adapter_dtype

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "policy, compute, expected",
    [
        ("bf16", FP16, BF16), ("bf16", BF16, BF16), ("bf16", FP32, BF16),
        ("fp32-if-fp16", FP16, FP32), ("fp32-if-fp16", BF16, BF16), ("fp32-if-fp16", FP32, FP32),
        ("fp32", FP16, FP32), ("fp32", BF16, FP32), ("fp32", FP32, FP32),
    ],
)
def test_policy_table(policy, compute, expected):
    assert resolve_adapter_dtype(policy, compute) == expected


def test_resolve_rejects_unknown_policy():
    with pytest.raises(ValueError, match="`adapter_dtype` must be one of"):
        resolve_adapter_dtype("fp8", FP16)


@pytest.mark.parametrize("compute", [FP16, BF16, FP32])
@pytest.mark.parametrize("model_dtype", [BF16, FP32])
def test_4bit_compute_dtype_comes_from_the_layer(compute, model_dtype):
    layer = bnb.nn.Linear4bit(16, 8, compute_dtype=compute)
    assert layer_compute_dtype(layer, model_dtype=model_dtype) == compute


@pytest.mark.parametrize("compute", [BF16, FP32])
def test_4bit_layer_of_an_fp16_model_computes_in_fp16(compute):
    """FastLoRA computes in the activation dtype: fp16 model -> fp16 gradients, whatever bnb_4bit_compute_dtype is."""
    layer = bnb.nn.Linear4bit(16, 8, compute_dtype=compute)
    assert layer_compute_dtype(layer, model_dtype=FP16) == FP16
    assert resolve_adapter_dtype("fp32-if-fp16", layer_compute_dtype(layer, model_dtype=FP16)) == FP32


@pytest.mark.parametrize("model_dtype", [FP16, BF16, FP32])
def test_8bit_compute_dtype_is_the_model_dtype(model_dtype):
    layer = bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=False)
    assert layer_compute_dtype(layer, model_dtype=model_dtype) == model_dtype


def test_plain_layer_uses_its_weight_dtype():
    assert layer_compute_dtype(torch.nn.Linear(4, 4, dtype=FP16), model_dtype=FP32) == FP16


def test_multihead_attention_adapters_follow_the_layer_dtype():
    """A layer without a `weight` (nn.MultiheadAttention) resolves the policy against its own parameters' dtype, not
    the model's (here: a bf16 attention in an fp32 model gives bf16 adapters under fp32-if-fp16)."""
    from peft import get_peft_model

    import peft_fastlora

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.mha = nn.MultiheadAttention(16, 2, dtype=BF16)

    model = get_peft_model(Block(), peft_fastlora.FastLoraConfig(r=4, target_modules=["mha"]))
    assert layer_compute_dtype(model.base_model.model.mha.get_base_layer(), FP32) == BF16
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {BF16}
