"""Supervised fine-tuning of a 4-bit (or 8-bit) model with a FastLoRA adapter and the Hugging Face Trainer.

With no ``--model`` it builds a tiny random Llama and a character-level tokenizer in code, so it runs offline on a
laptop CPU in seconds (the loss falls, the model learns nothing useful). With a model id or path it loads that model
and its tokenizer.

    python examples/train_sft.py --max-steps 20 --output-dir /tmp/fastlora/sft    # tiny model, CPU is fine
    python examples/train_sft.py --model Qwen/Qwen2.5-0.5B --bf16 --max-steps 200 --output-dir ~/fastlora/qwen-sft
    python examples/generate.py --adapter ~/fastlora/qwen-sft --prompt "Name the largest ocean."

The data is a JSONL file with one ``{"instruction": ..., "response": ...}`` object per line; the loss is taken on
the response tokens only. The data and the arguments are checked before any model is loaded. The adapter, the
tokenizer and (for the tiny model) the base model are saved to ``--output-dir``.
"""

from __future__ import annotations

from quiet import quiet_third_party

quiet_third_party()  # before torch/transformers/bitsandbytes are imported

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch
from peft import get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

import peft_fastlora  # registers PeftType.FASTLORA with PEFT

EXAMPLES_DIR = Path(__file__).resolve().parent
DEFAULT_DATA = EXAMPLES_DIR / "data" / "sample.jsonl"
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n### Response:\n"
TINY_BASE_DIR = "tiny-base"  # where the tiny model is saved inside --output-dir, so generate.py can load it again

# Same shape as tests/utils.py's tiny Llama, with room for character-level sequences.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
)


def char_tokenizer(vocab: list[str], **special_tokens: str) -> PreTrainedTokenizerFast:
    """A tokenizer that maps each character in ``vocab`` to its index, built in code (no download).

    A BPE model with no merges gives one token per character (characters not in ``vocab`` become ``unk_token``,
    or are dropped without one); ``Fuse`` joins the tokens back on decode. With a ``bos_token``, it is prepended.
    """
    from tokenizers import Tokenizer, decoders, models, processors

    ids = {token: i for i, token in enumerate(vocab)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token=special_tokens.get("unk_token")))
    tok.decoder = decoders.Fuse()
    if "bos_token" in special_tokens:
        bos = special_tokens["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer: 4 special tokens, printable ASCII, newline and tab (101 tokens)."""
    specials = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    return char_tokenizer(list(specials.values()) + chars, **specials)


def save_tiny_llama(path: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Saves a tiny random fp32 Llama (and ``tokenizer``) to ``path``; returns ``path``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        **TINY_LLAMA,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def quantization_config(bits: int, compute_dtype: torch.dtype, quant_type: str, double_quant: bool):
    """A ``BitsAndBytesConfig`` for 4-bit (NF4/FP4) or 8-bit weights."""
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
    )


def read_jsonl(path: Path) -> list[tuple[int, dict[str, str]]]:
    """``(line number, {"instruction": str, "response": str})`` for each non-blank line of a JSONL file.

    Raises:
        ValueError: naming ``path:line`` for a line that is not UTF-8, not JSON, or not an object with string
            ``instruction`` and ``response`` fields, and for a file without records.
    """
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                    "save the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err}).") from None
            if not isinstance(record, dict) or not all(
                isinstance(record.get(key), str) for key in ("instruction", "response")
            ):
                shown = repr(record) if len(repr(record)) <= 200 else repr(record)[:200] + "..."
                raise ValueError(
                    f"{path}:{lineno}: every line needs a JSON object with string fields 'instruction' and "
                    f"'response', got {shown}."
                )
            records.append((lineno, record))
    if not records:
        raise ValueError(f"{path} has no records.")
    return records


def load_jsonl(path: Path) -> list[dict[str, str]]:
    """Reads ``{"instruction": str, "response": str}`` records, one per line (blank lines are skipped)."""
    return [record for _, record in read_jsonl(path)]


def tokenize_example(tokenizer, record: dict[str, str], max_length: int) -> dict[str, list[int]]:
    """Prompt + response + EOS; labels are -100 on the prompt so that only the response is learned."""
    prompt = tokenizer(PROMPT_TEMPLATE.format(instruction=record["instruction"]))["input_ids"]
    response = tokenizer(record["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt + response)[:max_length]
    labels = ([-100] * len(prompt) + response)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def build_train_data(
    tokenizer, records: list[tuple[int, dict[str, str]]], max_length: int, path: Path
) -> list[dict[str, list[int]]]:
    """Tokenized examples that keep at least one response token within ``max_length``.

    An example whose prompt alone fills ``max_length`` would train on nothing: it is left out, with a note naming
    its line. When that leaves nothing, a ``ValueError`` says how long ``--max-length`` must be.
    """
    kept, dropped, longest = [], [], 0
    for lineno, record in records:
        whole = tokenize_example(tokenizer, record, max_length=sys.maxsize)
        longest = max(longest, len(whole["input_ids"]))
        example = {key: value[:max_length] for key, value in whole.items()}
        if any(label != -100 for label in example["labels"]):
            kept.append(example)
        else:
            dropped.append((lineno, whole["labels"].count(-100)))  # the prompt's length in tokens
    if dropped and not kept:
        shortest = min(n for _, n in dropped)
        raise ValueError(
            f"{path}:{dropped[0][0]}: the prompt of every example is at least --max-length {max_length} tokens long "
            f"(the shortest prompt is {shortest}), so no response token would be trained on; use --max-length "
            f"{shortest + 1} or more ({longest} keeps every example whole)."
        )
    if dropped:
        lines = ", ".join(str(lineno) for lineno, _ in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
        print(
            f"Left out {len(dropped)} of {len(records)} examples whose prompt fills --max-length {max_length} "
            f"(no response token to train on): {path} lines {lines}."
        )
    return kept


class PadCollator:
    """Right-pads a batch: ``input_ids`` with the pad id, ``labels`` with -100, and builds the attention mask."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            pad = width - len(f["input_ids"])
            batch["input_ids"].append(f["input_ids"] + [self.pad_token_id] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
            batch["labels"].append(f["labels"] + [-100] * pad)
        return {key: torch.tensor(value) for key, value in batch.items()}


def add_quantization_args(parser: argparse.ArgumentParser) -> None:
    """``--4bit/--8bit``, ``--quant-type`` and ``--double-quant``: how the base model is quantized (shared with
    ``generate.py``, which must load the base the way it was trained)."""
    bits = parser.add_mutually_exclusive_group()
    bits.add_argument("--4bit", dest="bits", action="store_const", const=4, help="4-bit base weights (default).")
    bits.add_argument("--8bit", dest="bits", action="store_const", const=8, help="8-bit (int8) base weights.")
    parser.add_argument("--quant-type", choices=("nf4", "fp4"), default=None, help="4-bit data type (default: nf4).")
    parser.add_argument("--double-quant", action="store_true", help="Double-quantize the 4-bit absmax scales.")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model id or local path (default: a tiny random Llama).")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="JSONL file of instruction/response pairs.")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("outputs/sft"), help="Where to save the adapter (default: outputs/sft)."
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 compute (model, bnb compute dtype, Trainer).")
    precision.add_argument(
        "--fp16", action="store_true", help="fp16 compute with GradScaler (for CUDA GPUs; runs, slowly, on a CPU)."
    )
    add_quantization_args(parser)
    parser.add_argument(
        "--adapter-dtype",
        choices=peft_fastlora.ADAPTER_DTYPE_POLICIES,
        default=None,
        help="FastLoraConfig.adapter_dtype policy (default: the config's default, 'fp32-if-fp16').",
    )
    parser.add_argument("--fp16-overflow-guard", action="store_true", help="Clamp fp16 overflows and report them.")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank.")
    parser.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (scaling = alpha / r).")
    parser.add_argument("--target-modules", default="all-linear", help="Comma-separated module names or all-linear.")
    parser.add_argument("--max-steps", type=int, default=30, help="Optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=4, help="Per-device batch size.")
    parser.add_argument("--lr", type=float, default=2e-4, help="Learning rate.")
    parser.add_argument("--max-length", type=int, default=256, help="Truncate examples to this many tokens.")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="Trade compute for activation memory.")
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    args = parser.parse_args(argv)
    if args.bits == 8 and (args.double_quant or args.quant_type is not None):
        flag = "--double-quant" if args.double_quant else f"--quant-type {args.quant_type}"
        parser.error(f"{flag} applies to 4-bit weights only; drop it, or use --4bit instead of --8bit.")
    args.bits = args.bits or 4
    args.quant_type = args.quant_type or "nf4"
    if not args.data.is_file():
        parser.error(f"--data {str(args.data)!r} is not a file.")
    for name in ("r", "lora_alpha", "max_steps", "batch_size", "max_length"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if not args.lr > 0:
        parser.error(f"--lr must be a positive number, got {args.lr}.")
    if args.model is not None:
        model_path = Path(args.model).expanduser()
        if model_path.exists() and not (model_path / "config.json").is_file():
            parser.error(f"--model {args.model!r} is a local path without a config.json; pass a model folder saved "
                         "with save_pretrained, or a Hub model id.")  # fmt: skip
        if not model_path.exists() and looks_like_a_path(args.model):
            parser.error(f"--model {args.model!r}: no such file or folder; pass an existing model folder, or a Hub "
                         "model id such as 'Qwen/Qwen2.5-0.5B'.")  # fmt: skip
        if model_path.exists():
            args.model = str(model_path)
    if args.fp16 and not torch.cuda.is_available():
        print("Note: --fp16 on a CPU runs, slowly: fp16 is meant for CUDA GPUs; on a CPU use --bf16 or no flag.")
    return args


def looks_like_a_path(model: str) -> bool:
    """Whether ``--model`` is meant as a local path rather than a Hub id (``name`` or ``org/name``)."""
    return model.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in model or model.count("/") > 1


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    try:
        records = read_jsonl(args.data)
    except ValueError as err:
        raise SystemExit(f"train_sft.py: error: --data: {err}") from None

    if args.model is None:
        tokenizer = build_char_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    try:
        train_data = build_train_data(tokenizer, records, args.max_length, args.data)
    except ValueError as err:
        raise SystemExit(f"train_sft.py: error: {err}") from None

    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        model_path = save_tiny_llama((args.output_dir / TINY_BASE_DIR).resolve(), tokenizer, seed=args.seed)
        print(f"No --model given: built a tiny random Llama in {model_path}.")
    else:
        model_path = args.model

    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=dtype,
        quantization_config=quantization_config(args.bits, dtype, args.quant_type, args.double_quant),
        device_map={"": 0} if torch.cuda.is_available() else None,
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()

    config_kwargs = {} if args.adapter_dtype is None else {"adapter_dtype": args.adapter_dtype}
    target_modules = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    lora_config = peft_fastlora.FastLoraConfig(
        r=args.r,
        lora_alpha=args.lora_alpha,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
        fp16_overflow_guard=args.fp16_overflow_guard,
        **config_kwargs,
    )
    model = get_peft_model(model, lora_config)
    model.print_trainable_parameters()

    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=max(1, min(10, args.max_steps // 5)),
        save_strategy="no",
        report_to="none",
        fp16=args.fp16,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_data,
        data_collator=PadCollator(tokenizer.pad_token_id),
    )
    result = trainer.train()
    print(f"Final training loss: {result.training_loss:.4f}")

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    if args.fp16_overflow_guard:
        overflows = {name: n for name, n in peft_fastlora.overflow_report(model).items() if n}
        print(f"fp16 overflow guard: {overflows or 'no layer overflowed'}")
    print(f"Saved the adapter and tokenizer to {args.output_dir}.")
    print(f"Generate with: python {Path(sys.argv[0]).parent / 'generate.py'} --adapter {args.output_dir}")


if __name__ == "__main__":
    main()
