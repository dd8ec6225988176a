"""FastLoraModel-level behaviour that is not about a single layer."""

import io
import logging
import pickle
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from peft_fastlora.bnb import FastLoraLinear4bit
from tests.utils import fast_config, load_quantized, logits

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _lora_dtypes(model, adapter: str = "default") -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n}


def test_dequantized_merge_saves_and_reloads_as_a_plain_model(tiny_llama_path, tmp_path):
    model = get_peft_model(
        load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32),
        fast_config(r=4, init_lora_weights=False),
    )
    ids = torch.randint(0, 128, (2, 7))
    model.eval()
    with torch.no_grad():
        before = model(ids).logits
    merged = model.merge_and_unload(dequantize=True)
    assert not getattr(merged, "is_quantized", False)
    assert not hasattr(merged.config, "quantization_config")
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=FP32)
    with torch.no_grad():
        after = reloaded(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_dequantized_merge_of_a_partial_adapter_saves_a_consistent_checkpoint(tiny_llama_path, tmp_path):
    """Layers the adapter does not target stay 4-bit; the dequantized ones are recorded as not to quantize, so the
    checkpoint reloads with `from_pretrained` (with the saved quantization_config) and gives the same logits.
    (down_proj is targeted because stock bitsandbytes on CPU cannot run a 4-bit layer with in_features 96.)"""
    model = get_peft_model(load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32),
                           fast_config(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    before = logits(model)
    merged = model.merge_and_unload(dequantize=True)
    skip = merged.config.quantization_config.llm_int8_skip_modules
    assert "model.layers.0.self_attn.q_proj" in skip and "lm_head" in skip
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=FP32)
    assert type(reloaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(reloaded.model.layers[0].self_attn.k_proj).__name__ == "Linear4bit"
    in_memory = logits(merged)
    torch.testing.assert_close(logits(reloaded), in_memory, atol=1e-5, rtol=1e-5)
    # bitsandbytes' CPU inference path rounds the untouched layers' absmax to bf16 once it has run: hence 2e-3
    torch.testing.assert_close(in_memory, before, atol=2e-3, rtol=2e-3)


def test_model_pickles_like_stock_peft(tiny_llama_path):
    """torch.save / pickle (multiprocessing spawn, Ray, joblib) work before any training forward."""
    model = get_peft_model(load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32),
                           fast_config(r=4, init_lora_weights=False))
    expected = logits(model)
    clone = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(logits(clone), expected, atol=0, rtol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.testing.assert_close(logits(torch.load(buffer, weights_only=False)), expected, atol=0, rtol=0)


def test_config_converting_no_quantized_layer_warns(tiny_llama_path):
    with pytest.warns(UserWarning, match=r"made no FastLoRA layer.*1 plain LoRA layers.*load_in_4bit=True"):
        get_peft_model(load_quantized(tiny_llama_path), fast_config(target_modules=["lm_head"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        get_peft_model(load_quantized(tiny_llama_path), fast_config(target_modules=["q_proj"]))


def test_get_peft_model_logs_one_summary_line(tiny_llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="peft_fastlora"):
        get_peft_model(load_quantized(tiny_llama_path), fast_config(target_modules=["q_proj", "down_proj", "lm_head"]))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("peft_fastlora")]
    assert len(lines) == 1, lines
    assert "4 FastLoRA layers (4 4-bit, 0 8-bit), 1 plain LoRA layers" in lines[0]
    assert "adapter dtype bfloat16 (adapter_dtype='fp32-if-fp16')" in lines[0]
    assert "pure-torch reference (CPU" in lines[0]


def test_from_pretrained_logs_the_summary_once(tiny_llama_path, tmp_path, caplog):
    """PEFT casts a loaded adapter twice (when made, and after its weights are loaded): one summary line, not two; a
    second adapter gets its own line."""
    get_peft_model(load_quantized(tiny_llama_path), fast_config(r=4)).save_pretrained(tmp_path / "adapter")
    with caplog.at_level(logging.INFO, logger="peft_fastlora"):
        model = PeftModel.from_pretrained(load_quantized(tiny_llama_path), tmp_path / "adapter")
        model.load_adapter(tmp_path / "adapter", adapter_name="other")
    lines = [r.getMessage() for r in caplog.records if "FastLoRA layers (" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("peft_fastlora: adapter 'default'")
    assert lines[1].startswith("peft_fastlora: adapter 'other'")


def test_add_weighted_adapter_follows_the_policy(tiny_llama_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config(r=4, init_lora_weights=False))
    assert _lora_dtypes(model) == {BF16}
    model.add_weighted_adapter(["default"], [1.0], "combined", combination_type="svd")
    assert _lora_dtypes(model, "combined") == {BF16}  # PEFT builds it in fp32
    layer = next(m for m in model.modules() if isinstance(m, FastLoraLinear4bit))
    assert layer.adapter_dtypes["combined"] == BF16 and layer.adapter_policies["combined"] == "fp32-if-fp16"


@pytest.mark.parametrize("cast, expected", [("half", FP32), ("float", FP32), ("bfloat16", BF16)])
def test_model_cast_reapplies_the_policy(tiny_llama_path, cast, expected):
    """fp32-if-fp16 on a bf16 model: bf16 adapters; after model.half() the activations are fp16 (fp32 adapters), after
    model.float() fp32 (fp32 adapters); a forward keeps what the cast decided."""
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config(r=4, init_lora_weights=False))
    getattr(model, cast)()
    assert _lora_dtypes(model) == {expected}
    logits(model)
    assert _lora_dtypes(model) == {expected}


def test_hotswap_adapter_swaps_a_fastlora_adapter(tiny_llama_path, tmp_path):
    from peft.utils.hotswap import hotswap_adapter

    for name, seed in (("one", 1), ("two", 2)):
        torch.manual_seed(seed)
        model = get_peft_model(load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32),
                               fast_config(r=4, init_lora_weights=False))
        model.save_pretrained(tmp_path / name)
    base = load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32)
    expected = logits(PeftModel.from_pretrained(base, tmp_path / "two"))
    model = PeftModel.from_pretrained(load_quantized(tiny_llama_path, dtype=FP32, compute_dtype=FP32), tmp_path / "one")
    first = logits(model)
    hotswap_adapter(model, str(tmp_path / "two"), adapter_name="default", torch_device="cpu")
    swapped = logits(model)
    assert not torch.allclose(first, expected)
    torch.testing.assert_close(swapped, expected, atol=0, rtol=0)
