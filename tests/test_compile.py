"""torch.compile(fullgraph=True) through FastLoRA layers: no graph breaks, same results as eager."""

import pytest
import torch
from peft import get_peft_model

import peft_fastlora
from tests.utils import load_quantized


def fastlora_layer(path, bits, device="cpu"):
    kwargs = {"bits": 8} if bits == 8 else {"bits": 4, "double_quant": True, "compute_dtype": torch.bfloat16}
    model = get_peft_model(load_quantized(path, dtype=torch.bfloat16, **kwargs).to(device),
                           peft_fastlora.FastLoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    return model.base_model.model.model.layers[0].mlp.down_proj


@pytest.mark.parametrize("bits", [4, 8])
def test_fullgraph_through_a_layer_on_cpu(tiny_llama_path, bits):
    layer = fastlora_layer(tiny_llama_path, bits)
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    eager = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, eager)
    out.float().sum().backward()
    assert x.grad is not None and layer.lora_B["default"].weight.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [4, 2048])
def test_fullgraph_inductor_through_a_layer_on_gpu(tiny_llama_path, bits, m):
    layer = fastlora_layer(tiny_llama_path, bits, device="cuda")
    x = torch.randn(m, layer.in_features, dtype=torch.bfloat16, device="cuda", requires_grad=m > 16)
    eager = layer(x)
    torch._dynamo.reset()
    out = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    if x.requires_grad:
        out.float().sum().backward()
        assert layer.lora_A["default"].weight.grad is not None


@pytest.mark.gpu
def test_fullgraph_whole_model_on_gpu(tiny_llama_path):
    model = get_peft_model(load_quantized(tiny_llama_path, dtype=torch.bfloat16).to("cuda"),
                           peft_fastlora.FastLoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    model.eval()
    with torch.no_grad():
        eager = model(ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model.base_model.model, fullgraph=True)(ids).logits
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=3e-2)
