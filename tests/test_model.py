"""FastLoraModel-level behaviour that is not about a single layer."""

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import peft_fastlora
from tests.utils import load_quantized


def test_dequantized_merge_saves_and_reloads_as_a_plain_model(tiny_llama_path, tmp_path):
    model = get_peft_model(
        load_quantized(tiny_llama_path, dtype=torch.float32, compute_dtype=torch.float32),
        peft_fastlora.FastLoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    )
    ids = torch.randint(0, 128, (2, 7))
    model.eval()
    with torch.no_grad():
        before = model(ids).logits
    merged = model.merge_and_unload(dequantize=True)
    assert not getattr(merged, "is_quantized", False)
    assert not hasattr(merged.config, "quantization_config")
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        after = reloaded(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
