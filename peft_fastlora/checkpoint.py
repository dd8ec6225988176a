"""A plain transformers checkpoint from a base model and an adapter: ``export_merged`` (``peft-fastlora merge``).

The adapter was trained on the *quantized* base, so the merge loads the base quantized exactly as the adapter's card
records, merges with the lossless ``merge_and_unload(dequantize=True)``, dequantizes the layers no adapter targets, and
saves an unquantized checkpoint that loads without PEFT or bitsandbytes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel

from ._atomic import staged_write
from .export import (
    ADAPTER_CONFIG,
    SAFETENSORS_WEIGHTS,
    CorruptAdapterError,
    PathLike,
    adapter_folder,
    adapter_subfolders,
    load_lora_as_fastlora,
    read_source_card,
    safetensors_header,
)

logger = logging.getLogger(__name__)

CHECKPOINT_WEIGHTS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                      "pytorch_model.bin.index.json")


def _bnb_config_from_facts(quant: Optional[dict]):
    """The ``BitsAndBytesConfig`` that the adapter's card records for the base model, or None."""
    if not quant or quant.get("method") != "bitsandbytes":
        return None
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": quant["skip_modules"]} if quant.get("skip_modules") else {}
    if quant["bits"] == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant["quant_type"],
        bnb_4bit_compute_dtype=getattr(torch, quant["compute_dtype"]),
        bnb_4bit_use_double_quant=quant["double_quant"],
        bnb_4bit_quant_storage=getattr(torch, quant["quant_storage"]),
        **skip,
    )


def _dequantize_remaining(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Dequantizes the bitsandbytes layers that no adapter targeted (transformers' ``dequantize``), leaves every
    parameter in ``dtype`` and the model without quantization markers; returns how many layers it dequantized."""
    import bitsandbytes as bnb

    left = sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules())
    if left:
        if getattr(model, "hf_quantizer", None) is None:
            raise RuntimeError(f"{left} bitsandbytes layers are left after the merge and the model has no quantizer "
                               "to dequantize them with.")
        model.dequantize(dtype=dtype)
    if getattr(model, "quantization_method", None) is not None:
        model.quantization_method = None  # else transformers refuses to cast or treats the model as quantized
    with torch.no_grad():  # parameter by parameter: rotary buffers stay fp32, as transformers keeps them
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    return left


def _check_merge_destination(dst: Path, sources: list[Path], overwrite: bool) -> None:
    real = dst.resolve()
    for source in sources:
        if real == source.resolve() or source.resolve() in real.parents or real in source.resolve().parents:
            raise ValueError(f"`dst_dir` {str(dst)!r} is, contains or lies inside {str(source)!r}, one of the inputs: "
                             "pick a new folder for the merged checkpoint.")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"`dst_dir` {str(dst)!r} is a file: pick a folder for the merged checkpoint.")
    if not dst.exists() or not any(dst.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"`dst_dir` {str(dst)!r} already exists and is not empty: pick a new folder, or pass `overwrite=True` "
            "(`--overwrite` on the command line) to replace the checkpoint in it."
        )
    if (dst / ADAPTER_CONFIG).is_file() or adapter_subfolders(dst):
        raise FileExistsError(f"`dst_dir` {str(dst)!r} holds an adapter, which `overwrite` does not replace: pick a "
                              "new folder, or delete that adapter yourself if you mean to replace it.")


def export_merged(
    base_model: PathLike,
    adapter_dir: PathLike,
    dst_dir: PathLike,
    *,
    subfolder: Optional[str] = None,
    dtype: Optional[str] = None,
    device: str = "cpu",
    overwrite: bool = False,
) -> Path:
    """Writes a plain transformers checkpoint of ``base_model`` with the adapter merged in (no PEFT, no quantization).

    The base model is loaded as the adapter was trained on it: quantized as the adapter's model card records (4-bit
    or 8-bit bitsandbytes), in the recorded model dtype. The adapter (FastLoRA, or plain LoRA, loaded into FastLoRA
    layers) is merged with ``merge_and_unload(dequantize=True)``: each targeted layer becomes ``dequant(W) +
    scaling * B @ A`` computed in fp32, nothing is requantized; the quantized layers no adapter targets are
    dequantized too. The model is cast to ``dtype`` and saved with ``save_pretrained`` (safetensors), with the
    tokenizer found next to the adapter or the base; the files are written beside ``dst_dir`` and moved into place.

    Args:
        base_model (`str` or `Path`): Folder or Hub id of the base model the adapter was trained on.
        adapter_dir (`str` or `Path`): Folder (or Hub id) of a FastLoRA or plain LoRA adapter. Without a local
            card recording the quantization, the base model is loaded as its own checkpoint says.
        dst_dir (`str` or `Path`): Folder to write the merged checkpoint to.
        subfolder (`str`, *optional*): The adapter's subfolder in ``adapter_dir``.
        dtype (`str`, *optional*): ``"bfloat16"``, ``"float16"`` or ``"float32"``: the saved weights' dtype (default:
            16-bit: the model dtype recorded in the card if it is 16-bit, else the 4-bit compute dtype if it is,
            else ``"bfloat16"``).
        device (`str`, defaults to `"cpu"`): Where to load and merge (``"cuda:0"`` for a large model).
        overwrite (`bool`, defaults to `False`): Replace the checkpoint in a non-empty ``dst_dir`` (never an adapter).

    Returns:
        `Path`: ``dst_dir``.
    """
    import transformers

    from .model_card import FLOAT_NAMES, TASK_CLASSES, describe_quantization

    if dtype is not None and dtype not in FLOAT_NAMES:
        raise ValueError(f"`dtype` must be one of {list(FLOAT_NAMES)}, got {dtype!r}.")
    dst, local = Path(dst_dir), Path(adapter_dir).is_dir()
    text = str(adapter_dir)
    if not local and (text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text):
        raise FileNotFoundError(f"`adapter_dir` {text!r} is not a folder (and not a Hub id `user/name`): pass the "
                                "folder that save_pretrained wrote.")
    facts, config = None, None
    if local:
        src = adapter_folder(adapter_dir, subfolder, arg="adapter_dir")
        try:
            config = json.loads((src / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptAdapterError(f"{str(src / ADAPTER_CONFIG)!r} is not valid JSON ({err}).") from None
        if not isinstance(config, dict) or config.get("peft_type") not in ("FASTLORA", "LORA"):
            peft_type = config.get("peft_type") if isinstance(config, dict) else config
            raise ValueError(f"`adapter_dir` {str(src)!r} is not a FastLoRA or LoRA adapter (peft_type {peft_type!r}).")
        if (src / SAFETENSORS_WEIGHTS).is_file():
            safetensors_header(src / SAFETENSORS_WEIGHTS)
        _, facts = read_source_card(src, Path(adapter_dir))
    sources = [Path(adapter_dir)] + ([Path(base_model)] if Path(base_model).exists() else [])
    _check_merge_destination(dst, sources, overwrite)

    quantization = _bnb_config_from_facts(facts.get("quantization") if facts else None)
    # The whole model in the output dtype: merged weights are summed in fp32 and rounded once, to it. By default a
    # 16-bit one (what users of merged checkpoints expect): the model dtype, else the 4-bit compute dtype, else bf16.
    recorded = [(facts or {}).get("model_dtype"), ((facts or {}).get("quantization") or {}).get("compute_dtype")]
    out_dtype = dtype or next((d for d in recorded if d in ("bfloat16", "float16")), "bfloat16")
    task = TASK_CLASSES.get((facts or {}).get("task_type") or (config or {}).get("task_type") or "")
    auto_class = getattr(transformers, task[1] if task else "AutoModelForCausalLM")
    how = describe_quantization(facts) if facts else "as its checkpoint says (no card with the training quantization)"
    logger.info("Loading %s (%s) with %s", base_model, how, auto_class.__name__)
    base = auto_class.from_pretrained(str(base_model), quantization_config=quantization,
                                      dtype=getattr(torch, out_dtype), device_map={"": device})
    kwargs = {"subfolder": subfolder} if subfolder else {}
    if config is not None and config["peft_type"] == "FASTLORA":
        model = PeftModel.from_pretrained(base, str(adapter_dir), **kwargs)
    else:  # a plain LoRA adapter, in FastLoRA layers: their merge dequantizes instead of requantizing
        model = load_lora_as_fastlora(base, adapter_dir, **kwargs)
    merged = model.merge_and_unload(dequantize=True)
    dequantized = _dequantize_remaining(merged, getattr(torch, out_dtype))
    if getattr(merged.config, "quantization_config", None) is not None:
        raise RuntimeError("The merged model still has a quantization_config; refusing to save a checkpoint that "
                           "would reload as quantized.")
    tokenizer = _find_tokenizer([src if local else Path(adapter_dir), Path(base_model)])
    with staged_write(dst, supersedes={}, stale=CHECKPOINT_WEIGHTS) as staging:
        merged.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    logger.info("Merged the adapter (dequantized %d quantized layers it does not target); wrote a %s checkpoint%s "
                "to %s", dequantized, out_dtype, " with the tokenizer" if tokenizer is not None else "", dst)
    return dst


def _find_tokenizer(places: list[Path]):
    """The tokenizer saved next to the adapter, else the base model's; None when neither has one."""
    from transformers import AutoTokenizer

    for place in places:
        if place.is_dir() and any((place / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(str(place))
    return None
