"""peft-fastlora quickstart: a tiny QLoRA fine-tune that needs no download and no GPU.

Builds a tiny Llama in code, quantizes it to 4-bit NF4 with bitsandbytes, trains a FastLoRA adapter on a few dozen
synthetic sentences, saves the adapter (with its model card), reloads it with plain PEFT and generates.

    python examples/quickstart.py                         # seconds on 2 CPU cores; everything is deleted at the end
    python examples/quickstart.py --output-dir my-run     # keep the adapter (and the tiny base model it needs)

On a machine with a CUDA GPU it trains there in bf16 (that path has not been run on a GPU yet).
"""

from __future__ import annotations

from quiet import hide_loading_bars, quiet_third_party

quiet_third_party()  # before torch/transformers/bitsandbytes are imported

import argparse
import logging
import random
import tempfile
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import peft_fastlora

# A character-level vocabulary keeps the example offline: no tokenizer download.
VOCAB = list("\0abcdefghijklmnopqrstuvwxyz ,.:!?'0123456789")
STOI = {ch: i for i, ch in enumerate(VOCAB)}
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen"]
PLACES = ["mat", "log", "box", "hill", "bed", "pond", "barn", "tree"]
BASE_DIR = "tiny-base"  # the base model, saved next to the adapter so that generate.py can load both
PROMPT = "the cat sits"


def encode(text: str) -> list[int]:
    return [STOI[ch] for ch in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != 0)


def synthetic_samples(n: int, seed: int = 0) -> list[str]:
    """Short sentences with a learnable pattern: 'the <animal> sits on the <place>.'"""
    rng = random.Random(seed)
    return [f"the {rng.choice(ANIMALS)} sits on the {rng.choice(PLACES)}." for _ in range(n)]


def build_base_model(path: Path) -> LlamaConfig:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return config


def load_4bit(path: Path, dtype: torch.dtype, device: str):
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=dtype, device_map={"": device}
    )


def batches(samples: list[str], batch_size: int, device: str):
    for start in range(0, len(samples), batch_size):
        chunk = [encode(s) for s in samples[start : start + batch_size]]
        width = max(len(ids) for ids in chunk)
        ids = torch.tensor([row + [0] * (width - len(row)) for row in chunk], device=device)
        labels = ids.masked_fill(ids == 0, -100)
        yield ids, labels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="Passes over the samples (default: 12).")
    parser.add_argument("--samples", type=int, default=48, help="Synthetic training sentences (default: 48).")
    parser.add_argument("--batch-size", type=int, default=8, help="Sentences per optimizer step (default: 8).")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="Keep the adapter here (and the tiny base model in OUTPUT_DIR/tiny-base). Default: a temporary folder, "
        "deleted at the end.",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "samples", "batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if args.output_dir is not None and args.output_dir.exists() and any(args.output_dir.iterdir()):
        parser.error(f"--output-dir {str(args.output_dir)!r} already exists and is not empty; pick a new folder.")
    return args


def train(model, samples: list[str], args: argparse.Namespace, device: str) -> list[float]:
    """AdamW over the adapter parameters; a progress bar shows the loss of each step. Returns the step losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    steps_per_epoch = -(-len(samples) // args.batch_size)
    losses = []
    model.train()
    with tqdm(total=args.epochs * steps_per_epoch, desc="Training", unit="step") as progress:
        for epoch in range(args.epochs):
            for ids, labels in batches(samples, args.batch_size, device):
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                progress.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.3f}", refresh=False)
                progress.update()
    return losses


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it, else absolute: what a user would type."""
    path = path.resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace, work: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out_dir = args.output_dir if args.output_dir is not None else work
    base_dir = out_dir / BASE_DIR

    config = build_base_model(base_dir)
    model = get_peft_model(
        load_4bit(base_dir, dtype, device),
        peft_fastlora.FastLoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainable, total = model.get_nb_trainable_parameters()
    print(
        f"Base model:  tiny random Llama ({config.num_hidden_layers} layers, hidden {config.hidden_size}), 4-bit NF4 "
        f"with double quantization, {str(dtype).removeprefix('torch.')} compute on {device}"
    )
    print(f"Adapter:     FastLoRA r=16 on all linear layers, {trainable:,} trainable of {total:,} parameters")

    losses = train(model, synthetic_samples(args.samples), args, device)
    print(f"Loss:        {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} step{'s' if len(losses) > 1 else ''}")
    if len(losses) > 1 and not losses[-1] < losses[0]:
        raise SystemExit("quickstart.py: error: the loss did not fall; please report this with the output above.")

    model.save_pretrained(out_dir)
    if args.output_dir is None:
        print(f"Saved:       {out_dir} (a temporary folder, deleted at the end; --output-dir DIR keeps it)")
    else:
        print(f"Saved:       {shown(out_dir)} (adapter_config.json, adapter_model.safetensors, README.md model card;")
        print(f"             the tiny base model it needs in {shown(base_dir)})")

    reloaded = PeftModel.from_pretrained(load_4bit(base_dir, dtype, device), out_dir)
    reloaded.eval()
    prompt = torch.tensor([encode(PROMPT)], device=device)
    with torch.no_grad():
        generated = reloaded.generate(input_ids=prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    print(f"Generated:   {decode(generated[0].tolist())!r} (reloaded with PeftModel.from_pretrained)")

    examples = Path(__file__).parent
    if args.output_dir is None:
        first = ("Keep the adapter:", f"python {shown(examples / 'quickstart.py')} --output-dir DIR")
    else:
        command = f"python {shown(examples / 'generate.py')} --adapter {shown(out_dir)} --raw --prompt 'the dog sits'"
        first = ("Generate with it:", command)
    hints = [
        first,
        ("Fine-tune your model:", f"python {shown(examples / 'train_sft.py')} --help"),
        ("FastLoRA in your code:", shown(examples.parent / "docs" / "index.md")),
    ]
    width = max(len(what) for what, _ in hints)
    print("Next:")
    for what, command in hints:
        print(f"  {what:<{width}}  {command}")


def show_fastlora_log() -> None:
    """peft-fastlora logs what ``get_peft_model`` converted (INFO); a script shows it, as a library does not."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("FastLoRA:    %(message)s"))
    logger = logging.getLogger("peft_fastlora")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    show_fastlora_log()
    hide_loading_bars()
    with tempfile.TemporaryDirectory(prefix="fastlora-quickstart-") as work:
        run(args, Path(work))


if __name__ == "__main__":
    main()
