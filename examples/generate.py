"""Generate text with a quantized base model and a FastLoRA adapter.

    python examples/generate.py --adapter outputs/sft --prompt "Name the largest ocean."
    python examples/generate.py --adapter out/qwen-sft --bf16 --merge   # merge losslessly into an unquantized model

The base model defaults to the ``base_model_name_or_path`` recorded in the adapter's ``adapter_config.json`` (for
the tiny model of ``train_sft.py``, the ``tiny-base`` folder it saved). The tokenizer is read from the adapter
folder, else from the base model; a model with neither (such as a tiny test model) gets the character-level
tokenizer of ``train_sft.py``.

On CUDA, decoding (a few tokens per step, no grad) runs FastLoRA's fused small-M kernel; on CPU, the pure-torch
reference path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel
from train_sft import PROMPT_TEMPLATE, add_quantization_args, build_char_tokenizer, char_tokenizer, quantization_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import peft_fastlora  # noqa: F401  (registers PeftType.FASTLORA, so PeftModel can load FastLoRA adapters)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True, help="Folder with adapter_config.json (an adapter).")
    parser.add_argument("--base", default=None, help="Base model id or path (default: the adapter's base model).")
    parser.add_argument("--prompt", default="Name the largest ocean.", help="The instruction to answer.")
    parser.add_argument("--raw", action="store_true", help="Feed --prompt as is, without the SFT prompt template.")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate.")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 compute.")
    precision.add_argument("--fp16", action="store_true", help="fp16 compute.")
    add_quantization_args(parser)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="Merge the adapter with merge_and_unload(dequantize=True) first: an unquantized model, no rounding loss.",
    )
    args = parser.parse_args(argv)
    args.bits = args.bits or 4
    config_file = args.adapter / "adapter_config.json"
    if not config_file.is_file():
        parser.error(f"--adapter {str(args.adapter)!r} has no adapter_config.json; pass the folder of a saved adapter.")
    if args.base is None:
        args.base = json.loads(config_file.read_text()).get("base_model_name_or_path")
        if not args.base:
            parser.error(f"{config_file} records no base model; pass --base.")
        if args.base.startswith("/") and not Path(args.base).exists():
            parser.error(f"the base model {args.base!r} recorded in {config_file} no longer exists; pass --base.")
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}.")
    return args


def fallback_tokenizer(vocab_size: int):
    """A character-level tokenizer for a base model saved without one, chosen by the model's vocab size.

    ``train_sft.py``'s tiny model saves its tokenizer, so this is for models such as ``quickstart.py``'s, whose
    character vocabulary (``quickstart.VOCAB``, id 0 = padding) is rebuilt here.
    """
    tokenizer = build_char_tokenizer()
    if len(tokenizer) == vocab_size:
        return tokenizer
    try:
        from quickstart import VOCAB
    except ImportError:
        VOCAB = None
    if VOCAB is not None and len(VOCAB) == vocab_size:
        print("Using quickstart.py's character vocabulary (lower-case letters, digits, punctuation); pass --raw.")
        return char_tokenizer(list(VOCAB), pad_token=VOCAB[0])
    return None


def load_tokenizer(adapter: Path, base: str, vocab_size: int):
    """The adapter's tokenizer, else the base model's, else a character-level one that fits the vocab."""
    for source in (adapter, base):
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError):
            continue
    tokenizer = fallback_tokenizer(vocab_size)
    if tokenizer is None:
        raise SystemExit(
            f"No tokenizer found in {str(adapter)!r} or {base!r}; save one next to the adapter "
            "(`tokenizer.save_pretrained(adapter_dir)`)."
        )
    return tokenizer


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"

    base = AutoModelForCausalLM.from_pretrained(
        args.base,
        dtype=dtype,
        quantization_config=quantization_config(args.bits, dtype, args.quant_type, args.double_quant),
        device_map={"": 0} if device == "cuda" else None,
    )
    model = PeftModel.from_pretrained(base, args.adapter)
    if args.merge:
        model = model.merge_and_unload(dequantize=True)
    model.eval()

    vocab_size = AutoConfig.from_pretrained(args.base).vocab_size
    tokenizer = load_tokenizer(args.adapter, args.base, vocab_size)
    text = args.prompt if args.raw else PROMPT_TEMPLATE.format(instruction=args.prompt)
    inputs = tokenizer(text, return_tensors="pt").to(device)
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(text + completion)


if __name__ == "__main__":
    main()
