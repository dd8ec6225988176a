"""peft-fastlora quickstart: a tiny QLoRA fine-tune that needs no download and no GPU.

Builds a tiny Llama in code, quantizes it to 4-bit NF4 with bitsandbytes, trains a FastLoRA adapter on a few dozen
synthetic samples, saves the adapter (with its model card), reloads it and generates.

    python examples/quickstart.py            # seconds on 2 idle CPU cores (it picks a GPU if there is one;
                                             # that path has not been run on a GPU yet)
"""

from __future__ import annotations

import argparse
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


def encode(text: str) -> list[int]:
    return [STOI[ch] for ch in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != 0)


def synthetic_samples(n: int, seed: int = 0) -> list[str]:
    """Short sentences with a learnable pattern: 'the <animal> sits on the <place>.'"""
    rng = random.Random(seed)
    return [f"the {rng.choice(ANIMALS)} sits on the {rng.choice(PLACES)}." for _ in range(n)]


def build_base_model(path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def load_4bit(path: Path, dtype: torch.dtype, device: str):
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True
    )
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=dtype,
                                                device_map={"": device})


def batches(samples: list[str], batch_size: int, device: str):
    for start in range(0, len(samples), batch_size):
        chunk = [encode(s) for s in samples[start : start + batch_size]]
        width = max(len(ids) for ids in chunk)
        ids = torch.tensor([row + [0] * (width - len(row)) for row in chunk], device=device)
        labels = ids.masked_fill(ids == 0, -100)
        yield ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--output-dir", type=Path, default=None, help="where to save the adapter (default: a temp dir)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="fastlora-quickstart-"))
    out_dir = args.output_dir or work / "adapter"
    build_base_model(work / "base")

    model = get_peft_model(
        load_4bit(work / "base", dtype, device),
        peft_fastlora.FastLoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM",
                                     adapter_dtype="fp32-if-fp16"),
    )
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    samples = synthetic_samples(args.samples)

    model.train()
    losses = []
    progress = tqdm(range(args.epochs), desc="QLoRA fine-tune", unit="epoch")
    for epoch in progress:
        epoch_losses = []
        for ids, labels in batches(samples, batch_size=8, device=device):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            epoch_losses.append(loss.item())
        losses.append(sum(epoch_losses) / len(epoch_losses))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        tqdm.write(f"epoch {epoch + 1:2d}  loss {losses[-1]:.3f}")
    print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not fall: something is wrong")

    model.save_pretrained(out_dir)
    print(f"saved adapter + model card to {out_dir}: {sorted(p.name for p in out_dir.iterdir())}")

    reloaded = PeftModel.from_pretrained(load_4bit(work / "base", dtype, device), out_dir)
    reloaded.eval()
    prompt = torch.tensor([encode("the cat sits")], device=device)
    with torch.no_grad():
        generated = reloaded.generate(input_ids=prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    print(f"generated: {decode(generated[0].tolist())!r}")


if __name__ == "__main__":
    main()
