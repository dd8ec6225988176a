"""Interop with plain LoRA: export a FastLoRA adapter for stock PEFT, and load a plain LoRA adapter into FastLoRA.

A FastLoRA adapter *is* a LoRA adapter: same tensors, same key names (``...lora_A.weight``), same files. Only its
``adapter_config.json`` differs: ``"peft_type": "FASTLORA"`` plus the FastLoRA-only fields (``adapter_dtype``,
``fp16_overflow_guard``). [`export_lora`] rewrites that config and copies the weights untouched;
[`load_lora_as_fastlora`] goes the other way, building a [`FastLoraConfig`] from a ``LoraConfig``.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Optional, Union

import torch
from huggingface_hub import ModelCard, ModelCardData
from peft import LoraConfig, PeftConfig, PeftModel

from .config import FastLoraConfig
from .dtypes import DEFAULT_ADAPTER_DTYPE
from .model_card import read_facts, render_plain_lora_block, replace_block, set_tags

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
README = "README.md"
FASTLORA_ONLY_FIELDS = tuple(sorted({f.name for f in fields(FastLoraConfig)} - {f.name for f in fields(LoraConfig)}))
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}

PathLike = Union[str, Path]


def _adapter_folder(src_dir: PathLike, subfolder: Optional[str]) -> Path:
    """The folder holding the adapter's ``adapter_config.json``, with a clear error when there is none."""
    root = Path(src_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"`src_dir` {str(root)!r} is not a folder: pass the folder that save_pretrained wrote.")
    src = root / subfolder if subfolder else root
    if not (src / ADAPTER_CONFIG).is_file():
        nested = sorted(p.parent.name for p in src.glob(f"*/{ADAPTER_CONFIG}")) if src.is_dir() else []
        hint = (
            f" It has adapters in the subfolders {nested}: pass one as `subfolder` (`--subfolder` on the command line)."
            if nested
            else " Pass the folder that `save_pretrained` wrote."
        )
        where = f"`subfolder` {subfolder!r} of {str(root)!r}" if subfolder else f"`src_dir` {str(root)!r}"
        raise FileNotFoundError(f"{where} has no {ADAPTER_CONFIG}.{hint}")
    return src


def _tensor_dtypes(path: Path) -> list[str]:
    """The dtypes stored in a safetensors file, read from its header (no tensor is loaded)."""
    if path.suffix != ".safetensors":
        return []
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    found = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return sorted(_SAFETENSORS_DTYPES.get(d, d.lower()) for d in found)


def _write_export_card(src: Path, root: Path, dst: Path, config: dict, subfolder: Optional[str], dtypes: list[str]):
    """README.md of the export: the source card (PEFT writes it in the root folder) with the plain-LoRA section."""
    source = next((p for p in (src / README, root / README) if p.is_file()), None)
    card = ModelCard.load(source) if source else ModelCard.from_template(ModelCardData())
    facts = read_facts(card.text)
    if facts:  # keep the exported adapter only, now at the top of its folder
        picked = [a for a in facts["adapters"] if a["subfolder"] == subfolder] or facts["adapters"][:1]
        facts["adapters"] = [{**picked[0], "name": "default", "subfolder": None}]
    base = config.get("base_model_name_or_path")
    card.data.library_name = "peft"
    add = {"lora"}
    if base:
        card.data.base_model = card.data.base_model or base
        add.add(f"base_model:adapter:{base}")
    set_tags(card, add, {"fastlora"})
    card.text = replace_block(card.text, render_plain_lora_block(facts, dtypes))
    card.save(dst / README)


def export_lora(
    src_dir: PathLike, dst_dir: PathLike, *, subfolder: Optional[str] = None, overwrite: bool = False
) -> Path:
    """Writes a plain PEFT ``LORA`` copy of a saved FastLoRA adapter, loadable without peft_fastlora.

    The weight file is copied byte for byte; ``adapter_config.json`` gets ``"peft_type": "LORA"`` and loses the
    FastLoRA-only fields; README.md says how to load the copy with stock PEFT.

    Args:
        src_dir (`str` or `Path`): Folder that ``save_pretrained`` wrote the FastLoRA adapter to.
        dst_dir (`str` or `Path`): Folder to write the plain LoRA adapter to.
        subfolder (`str`, *optional*): The adapter's subfolder in ``src_dir`` (``save_pretrained`` puts each adapter
            not named ``"default"`` in a subfolder named after it).
        overwrite (`bool`, defaults to `False`): Write into ``dst_dir`` even if it exists and is not empty.

    Returns:
        `Path`: ``dst_dir``.

    Example:

    ```py
    >>> peft_fastlora.export_lora("out/my-adapter", "out/my-adapter-lora")
    ```
    """
    root = Path(src_dir)
    src = _adapter_folder(root, subfolder)
    config = json.loads((src / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    peft_type = config.get("peft_type")
    if peft_type != "FASTLORA":
        extra = " It is a plain LoRA adapter, which stock PEFT loads: nothing to export." if peft_type == "LORA" else ""
        raise ValueError(
            f"{str(src)!r} is not a FastLoRA adapter: its {ADAPTER_CONFIG} has peft_type {peft_type!r}, expected "
            f"'FASTLORA'.{extra}"
        )
    weights = [src / name for name in WEIGHT_FILES if (src / name).is_file()]
    if not weights:
        raise FileNotFoundError(f"{str(src)!r} has no adapter weights ({' or '.join(WEIGHT_FILES)}).")
    dst = Path(dst_dir)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"`dst_dir` {str(dst)!r} is the adapter's own folder: pick a new folder for the export.")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"`dst_dir` {str(dst)!r} is a file: pick a folder for the export.")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(
            f"`dst_dir` {str(dst)!r} already exists and is not empty: pick a new folder, or pass `overwrite=True` "
            "(`--overwrite` on the command line) to write into it."
        )
    dst.mkdir(parents=True, exist_ok=True)

    lora_config = {k: v for k, v in config.items() if k not in FASTLORA_ONLY_FIELDS}
    lora_config["peft_type"] = "LORA"
    (dst / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in WEIGHT_FILES:  # no stale weight file of an earlier export may shadow the new one
        (dst / name).unlink(missing_ok=True)
    for path in weights:
        shutil.copyfile(path, dst / path.name)
    dtypes = sorted({d for path in weights for d in _tensor_dtypes(path)})
    _write_export_card(src, root, dst, config, subfolder, dtypes)
    return dst


def fastlora_config_from_lora(
    lora_config: LoraConfig, adapter_dtype: str = DEFAULT_ADAPTER_DTYPE, fp16_overflow_guard: bool = False
) -> FastLoraConfig:
    """A [`FastLoraConfig`] with every field of ``lora_config`` plus the given FastLoRA settings."""
    values = {
        f.name: copy.deepcopy(getattr(lora_config, f.name))
        for f in fields(LoraConfig)
        if f.init and f.name != "peft_type" and hasattr(lora_config, f.name)
    }
    try:
        return FastLoraConfig(**values, adapter_dtype=adapter_dtype, fp16_overflow_guard=fp16_overflow_guard)
    except ValueError as err:
        raise ValueError(f"This LoRA adapter cannot be loaded into FastLoRA layers: {err}") from err


def load_lora_as_fastlora(
    model: torch.nn.Module,
    lora_dir: PathLike,
    adapter_dtype: str = DEFAULT_ADAPTER_DTYPE,
    adapter_name: str = "default",
    *,
    fp16_overflow_guard: bool = False,
    **kwargs,
) -> PeftModel:
    """Loads a plain PEFT LoRA adapter into FastLoRA layers (to train it further, or to run it faster).

    The adapter's ``LoraConfig`` becomes a [`FastLoraConfig`] with the given ``adapter_dtype`` policy; the weights
    load as they are (cast to the policy's dtype). Saving the result writes a FastLoRA adapter; [`export_lora`] turns
    it back into a plain one.

    Args:
        model (`torch.nn.Module`): The base model (quantized or not), or a FastLoRA `PeftModel` to add the adapter to.
        lora_dir (`str` or `Path`): Folder or Hub id of the LoRA adapter.
        adapter_dtype (`str`, defaults to `"fp32-if-fp16"`): The FastLoRA adapter dtype policy.
        adapter_name (`str`, defaults to `"default"`): Name to give the adapter.
        fp16_overflow_guard (`bool`, defaults to `False`): See [`FastLoraConfig`].
        kwargs: Passed to ``PeftModel.from_pretrained`` (e.g. ``is_trainable=True``, ``subfolder``, ``revision``).

    Returns:
        `peft.PeftModel`: The model with the adapter in FastLoRA layers.

    Example:

    ```py
    >>> model = peft_fastlora.load_lora_as_fastlora(base, "some-user/some-lora", is_trainable=True)
    ```
    """
    hub_kwargs = {k: kwargs[k] for k in ("subfolder", "revision", "cache_dir", "token") if k in kwargs}
    config = PeftConfig.from_pretrained(str(lora_dir), **hub_kwargs)
    if not isinstance(config, LoraConfig):
        peft_type = getattr(config.peft_type, "value", config.peft_type)
        raise ValueError(
            f"`lora_dir` {str(lora_dir)!r} holds a {peft_type} adapter, not a LoRA one: only LoRA adapters can "
            "be loaded into FastLoRA layers."
        )
    fast_config = fastlora_config_from_lora(config, adapter_dtype, fp16_overflow_guard)
    if not isinstance(model, PeftModel):
        return PeftModel.from_pretrained(model, str(lora_dir), adapter_name=adapter_name, config=fast_config, **kwargs)

    # A PeftModel: add the adapter under the FastLoRA config, then let PEFT load its weights into it.
    is_trainable = kwargs.pop("is_trainable", False)
    fast_config.inference_mode = not is_trainable
    model.add_adapter(
        adapter_name,
        fast_config,
        low_cpu_mem_usage=kwargs.get("low_cpu_mem_usage", False),
        autocast_adapter_dtype=kwargs.get("autocast_adapter_dtype", True),
    )
    result = model.load_adapter(str(lora_dir), adapter_name, is_trainable=is_trainable, **kwargs)
    if is_trainable:
        model.set_requires_grad(adapter_name)
    if result.missing_keys:
        warnings.warn(f"Missing adapter keys while loading {str(lora_dir)!r}: {result.missing_keys}", stacklevel=2)
    return model
