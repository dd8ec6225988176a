"""Generate text with a quantized base model and a FastLoRA adapter.

    python examples/generate.py --adapter /tmp/fastlora/sft --prompt "Name the largest ocean."
    python examples/generate.py --adapter ~/fastlora/qwen-sft --merge   # merge losslessly into an unquantized model
    python examples/generate.py --adapter /tmp/fastlora/sft --graphed   # decode as CUDA-graph replays (GPU)

The base model defaults to the ``base_model_name_or_path`` recorded in the adapter's ``adapter_config.json`` (for
the tiny model of ``train_sft.py``, the ``tiny-base`` folder it saved). It is loaded the way it was quantized for
training, as the adapter's model card (its README.md) records: 4-bit or 8-bit, the 4-bit type, double quantization,
quant storage and compute dtype, and the model dtype. ``--4bit/--8bit``, ``--quant-type``, ``--double-quant`` and
``--bf16/--fp16`` override the card; an adapter without a FastLoRA card (a plain LoRA export, say) gets a 4-bit NF4
base unless told otherwise. The tokenizer is read from the adapter folder, else from the base model; a model with
neither (such as a tiny test model) gets the character-level tokenizer of ``train_sft.py``.

On CUDA, decoding (a few tokens per step, no grad) runs FastLoRA's fused small-M kernel; on CPU, the pure-torch
reference path.
"""

from __future__ import annotations

from quiet import hide_loading_bars, quiet_third_party

quiet_third_party()  # before torch/transformers/bitsandbytes are imported

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel
from train_sft import PROMPT_TEMPLATE, build_char_tokenizer, char_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

import peft_fastlora  # registers PeftType.FASTLORA, so PeftModel can load FastLoRA adapters
from peft_fastlora.model_card import read_facts

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_4BIT = {"method": "bitsandbytes", "bits": 4, "quant_type": "nf4", "double_quant": False}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True, help="Folder with adapter_config.json (an adapter).")
    parser.add_argument("--base", default=None, help="Base model id or path (default: the adapter's base model).")
    parser.add_argument("--prompt", default="Name the largest ocean.", help="The instruction to answer.")
    parser.add_argument("--raw", action="store_true", help="Feed --prompt as is, without the SFT prompt template.")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate.")
    parser.add_argument("--graphed", action="store_true",
                        help="Decode with peft_fastlora.graphed_generate (CUDA graphs on a GPU) instead of generate.")
    card = " (default: as the adapter's model card records)"
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 model and compute dtype" + card + ".")
    precision.add_argument("--fp16", action="store_true", help="fp16 model and compute dtype" + card + ".")
    bits = parser.add_mutually_exclusive_group()
    bits.add_argument("--4bit", dest="bits", action="store_const", const=4, help="4-bit base weights" + card + ".")
    bits.add_argument("--8bit", dest="bits", action="store_const", const=8, help="8-bit base weights" + card + ".")
    parser.add_argument("--quant-type", choices=("nf4", "fp4"), default=None, help="4-bit data type" + card + ".")
    parser.add_argument(
        "--double-quant", action=argparse.BooleanOptionalAction, default=None, help="4-bit double quantization" + card
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="Merge the adapter with merge_and_unload(dequantize=True) first: an unquantized model, no rounding loss.",
    )
    args = parser.parse_args(argv)
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
    if args.bits == 8 and (args.quant_type is not None or args.double_quant is not None):
        flag = "--quant-type" if args.quant_type is not None else "--double-quant"
        parser.error(f"{flag} applies to 4-bit weights only; drop it, or use --4bit instead of --8bit.")
    return args


def card_facts(adapter: Path) -> Optional[dict]:
    """What the adapter's model card records about its training (``peft_fastlora.model_card``), or ``None``."""
    readme = adapter / "README.md"
    return read_facts(readme.read_text(encoding="utf-8")) if readme.is_file() else None


def base_loading(args: argparse.Namespace, facts: Optional[dict]) -> tuple[dict, str]:
    """The ``from_pretrained`` keyword arguments that load the base model as it was trained, and a line saying how.

    The card's facts give the quantization and the dtypes; command-line flags override each of them.
    """
    flag_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None
    if facts is None:
        quant, source = dict(DEFAULT_4BIT), "the adapter has no FastLoRA model card: 4-bit NF4 unless told otherwise"
        model_dtype = torch.float32
    else:
        quant, source = facts.get("quantization"), "as its model card records"
        model_dtype = DTYPES.get(facts.get("model_dtype") or "", torch.float32)
    if args.bits is not None and (quant is None or quant.get("bits") != args.bits):
        trained = f"a {quant['bits']}-bit" if quant and "bits" in quant else "an unquantized"
        source = f"--{args.bits}bit; the adapter was trained on {trained} base" if facts else f"--{args.bits}bit"
        quant = dict(DEFAULT_4BIT) if args.bits == 4 else {"method": "bitsandbytes", "bits": 8}
    dtype = flag_dtype or model_dtype
    kwargs: dict = {"dtype": dtype}
    if quant is None:
        return kwargs, f"not quantized, {str(dtype).removeprefix('torch.')} ({source})"
    if quant.get("method") != "bitsandbytes":
        raise SystemExit(
            f"generate.py: error: the base model was quantized with {quant.get('method')!r} for training, which this "
            "example cannot rebuild; load it as its model card shows."
        )
    skip = quant.get("skip_modules")
    if quant["bits"] == 8:
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
        return kwargs, f"bitsandbytes 8-bit, {str(dtype).removeprefix('torch.')} ({source})"
    quant_type = args.quant_type or quant.get("quant_type", "nf4")
    double_quant = args.double_quant if args.double_quant is not None else bool(quant.get("double_quant"))
    compute = flag_dtype or DTYPES.get(quant.get("compute_dtype") or "", dtype)
    storage = getattr(torch, quant.get("quant_storage") or "uint8")
    kwargs["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage,
        llm_int8_skip_modules=skip,
    )
    double = ", double quantization" if double_quant else ""
    how = f"bitsandbytes 4-bit {quant_type}{double}, {str(compute).removeprefix('torch.')} compute"
    return kwargs, f"{how} ({source})"


def load_model(args: argparse.Namespace):
    """The base model, loaded as the adapter was trained, with the adapter on top (merged with ``--merge``)."""
    kwargs, how = base_loading(args, card_facts(args.adapter))
    print(f"Base model: {args.base}, {how}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = AutoModelForCausalLM.from_pretrained(args.base, device_map={"": 0} if device == "cuda" else None, **kwargs)
    model = PeftModel.from_pretrained(base, args.adapter)
    if args.merge:
        model = model.merge_and_unload(dequantize=True)
    return model.eval()


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
    hide_loading_bars()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args)

    vocab_size = AutoConfig.from_pretrained(args.base).vocab_size
    tokenizer = load_tokenizer(args.adapter, args.base, vocab_size)
    text = args.prompt if args.raw else PROMPT_TEMPLATE.format(instruction=args.prompt)
    inputs = tokenizer(text, return_tensors="pt").to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if args.graphed:  # the decode loop replayed as CUDA graphs on a GPU (the same loop, eagerly, on a CPU)
        output = peft_fastlora.graphed_generate(
            model, inputs["input_ids"], inputs.get("attention_mask"), max_new_tokens=args.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=pad,
        )  # fmt: skip
    else:
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(text + completion)


if __name__ == "__main__":
    main()
