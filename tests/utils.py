"""The shared test helpers: tiny random models (no downloads), quantized loading, FastLoRA configs, tokens, logits and
adapter tensors. Test modules import from here rather than keeping their own copies."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

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
                   device: Optional[Union[str, int, torch.device]] = None, **bnb_kwargs):
    """Loads the model at ``path`` quantized with bitsandbytes (default: 4-bit nf4, bf16 compute).

    ``device`` places it with an explicit ``device_map`` (without one, transformers puts a bitsandbytes model on the
    GPU when there is one).
    """
    quantization = quantization or bnb_config(**bnb_kwargs)
    placement = {} if device is None else {"device_map": {"": device}}
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=dtype, **placement)


def fast_config(**overrides):
    """A ``FastLoraConfig`` on every linear layer: r=8, lora_alpha=16, CAUSAL_LM, unless ``overrides`` say otherwise."""
    import peft_fastlora

    return peft_fastlora.FastLoraConfig(
        **{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **overrides}
    )


def tokens(rows: int = 2, seq: int = 6, seed: int = 7) -> torch.Tensor:
    """Fixed random token ids for the tiny Llama's vocabulary."""
    return torch.randint(0, TINY_LLAMA["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
    """Logits on the CPU for ``ids`` (default: [`tokens`]), run on the model's device."""
    ids = (tokens() if ids is None else ids).to(next(model.parameters()).device)
    return model(input_ids=ids, **kwargs).logits.cpu()


def tiny_tokenizer():
    """A word-level tokenizer over the tiny Llama's 128 ids ("t0" .. "t127"), built in memory (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def adapter_tensors(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors as PEFT saves them (``get_peft_model_state_dict``), detached copies on the CPU."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def assert_same_tensors(got: dict, expected: dict) -> None:
    """Same keys, dtypes and values (bit for bit)."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())
