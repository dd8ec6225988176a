"""Builders for tiny random models (no downloads) shared by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Saves a tiny random Llama (fp32 weights) to ``path`` and returns it."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).save_pretrained(path)
    return path


def bnb_config(
    bits: int = 4,
    quant_type: str = "nf4",
    compute_dtype: torch.dtype = torch.bfloat16,
    double_quant: bool = False,
    quant_storage: torch.dtype = torch.uint8,
) -> BitsAndBytesConfig:
    """A ``BitsAndBytesConfig`` for 4-bit (``bits=4``) or 8-bit (``bits=8``) loading."""
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_quant_storage=quant_storage,
    )


def load_quantized(path: Path, dtype: torch.dtype = torch.bfloat16, quantization: Optional[BitsAndBytesConfig] = None,
                   **bnb_kwargs):
    """Loads the model at ``path`` quantized with bitsandbytes (default: 4-bit nf4, bf16 compute)."""
    quantization = quantization or bnb_config(**bnb_kwargs)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=dtype)
