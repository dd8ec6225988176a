"""Shared builders and probes for the safety tests: tiny quantized Llamas with FastLoRA or stock PEFT LoRA on top."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import peft_fastlora
from peft_fastlora import FastLoraLayer
from peft_fastlora.layer import RECAST_WARNING
from peft_fastlora.ops.reference import lora_linear_ref
from tests.utils import TINY_LLAMA, fast_config, load_quantized

VOCAB = TINY_LLAMA["vocab_size"]
SEQ = 16
RECAST_MARK = RECAST_WARNING.split("{", 1)[0]  # "FastLoRA adapter weights of '"
# bitsandbytes' native CPU dequantize_4bit is wrong when in_features is not a multiple of 64 (tests/utils' tiny Llama
# has intermediate_size=96, so its down_proj is affected); stock PEFT on CPU runs on it, so comparisons with stock
# PEFT use this size.
BNB_CPU_SAFE_INTERMEDIATE = 128


def load(path: Path, dtype: torch.dtype, device: str = "cpu", bits: int = 4, **bnb_kwargs):
    """A tiny quantized model on ``device`` (``bits`` 4 or 8; ``bnb_kwargs`` as ``tests.utils.bnb_config``)."""
    index = torch.device(device).index
    placement = None if device == "cpu" else (0 if index is None else index)
    return load_quantized(path, dtype=dtype, bits=bits, device=placement, **bnb_kwargs)


def fastlora(model, **config):
    """``get_peft_model`` with ``tests.utils.fast_config`` (every linear layer, r=8, alpha=16 unless given)."""
    return get_peft_model(model, fast_config(**config))


def stock_lora(model, autocast_adapter_dtype: bool = True, **config):
    """The same adapter with stock PEFT LoRA (``peft.LoraConfig``)."""
    kwargs = dict(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, LoraConfig(**{**kwargs, **config}), autocast_adapter_dtype=autocast_adapter_dtype)


def fastlora_layers(model) -> list[tuple[str, FastLoraLayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FastLoraLayer)]


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def token_batch(batch: int = 4, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``batch`` copies of one random sequence: a model memorizes it, so the loss visibly falls in a few steps."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, SEQ), generator=g).repeat(batch, 1).to(device)


def random_batch(batch: int = 4, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, SEQ), generator=g).to(device)


@torch.no_grad()
def randomize_adapters(model, std: float = 0.05, seed: int = 0) -> None:
    """Gives every ``lora_B`` random values (PEFT inits it to zero), so the LoRA term is non-zero."""
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.copy_(torch.randn(param.shape, generator=g) * std)


@torch.no_grad()
def copy_adapters(src, dst) -> None:
    """Copies the trainable parameters of ``src`` into ``dst`` by name (FastLoRA keeps LoRA's names)."""
    src_params, dst_params = trainable(src), trainable(dst)
    assert src_params.keys() == dst_params.keys()
    for name, param in dst_params.items():
        param.copy_(src_params[name])


def train_steps(model, ids: torch.Tensor, steps: int, lr: float = 1e-2) -> list[float]:
    """Plain AdamW steps on ``ids`` (labels = inputs); returns the losses."""
    model.train()
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fp32_reference(x, weight, bias, lora_a, lora_b, scaling, lora_x=None):
    """``fastlora_linear`` computed entirely in fp32 (W dequantized to fp32, LoRA in fp32), cast to ``x.dtype``."""
    f32 = None if lora_a is None else (lora_a.float(), lora_b.float())
    out = lora_linear_ref(
        x.float(),
        weight,
        None if bias is None else bias.float(),
        None if f32 is None else f32[0],
        None if f32 is None else f32[1],
        scaling,
        None if lora_x is None else lora_x.float(),
    )
    return out.to(x.dtype)


@contextlib.contextmanager
def fp32_reference_ops(monkeypatch) -> Iterator[None]:
    """Makes every FastLoRA layer compute with [`fp32_reference`] inside the block."""
    with monkeypatch.context() as m:
        m.setattr(peft_fastlora.ops, "fastlora_linear", fp32_reference)
        yield


class WeightDtypeSpy(TorchDispatchMode):
    """Records the dtype of every floating-point tensor shaped like a given weight (either orientation).

    The base matmul of a quantized layer must see its weight dequantized to the activation dtype; a dequant to the
    quant_state dtype shows up here as a weight-shaped tensor of that dtype.
    """

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.shapes = {(out_features, in_features), (in_features, out_features)}
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0] + tree_flatten(args)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) in self.shapes:
                self.seen.append((str(func), t.dtype))
        return out

    def matmul_dtypes(self) -> set[torch.dtype]:
        """Dtypes of weight-shaped operands of matmuls (mm, addmm, linear, matmul, bmm)."""
        ops = ("mm", "addmm", "linear", "matmul", "bmm")
        return {dtype for func, dtype in self.seen if func.split(".")[1] in ops}

    def dtypes(self) -> set[torch.dtype]:
        return {dtype for _, dtype in self.seen}


@contextlib.contextmanager
def recorded_warnings(action: str = "always") -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter(action)
        yield records


def recast_warnings(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(r.message) for r in records if str(r.message).startswith(RECAST_MARK)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_all_finite(tensors: dict[str, Optional[torch.Tensor]]) -> None:
    bad = [name for name, t in tensors.items() if t is None or not torch.isfinite(t).all()]
    assert not bad, f"missing or non-finite: {bad[:5]}"


def trainer_kwargs(tmp_path, device: str, precision: str, steps: int) -> dict:
    """The ``TrainingArguments`` (or TRL ``SFTConfig``) fields the safety tests share: small, quiet, seeded runs."""
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=device == "cpu",
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        seed=0,
    )
