"""Interop with plain LoRA: export a FastLoRA adapter for stock PEFT, and load a plain LoRA adapter into FastLoRA.

A FastLoRA adapter *is* a LoRA adapter: same tensors, same key names (``...lora_A.weight``), same files. Only its
``adapter_config.json`` differs: ``"peft_type": "FASTLORA"`` plus the FastLoRA-only fields (``adapter_dtype``,
``fp16_overflow_guard``). [`export_lora`] rewrites that config and copies the safetensors weights untouched (a
pickle ``.bin`` is converted, never copied), after checking every source file, and writes through a staging folder;
[`load_lora_as_fastlora`] goes the other way, building a [`FastLoraConfig`] from a ``LoraConfig``. The helpers that
read an adapter folder defensively (``adapter_folder``, ``safetensors_header``, ``read_source_card``) are shared with
``checkpoint.export_merged``.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Optional, Union

import torch
from huggingface_hub import ModelCard, ModelCardData
from peft import LoraConfig, PeftConfig, PeftModel
from safetensors.torch import save_file

from ._atomic import ADAPTER_WEIGHTS, staged_write
from .config import FastLoraConfig
from .dtypes import DEFAULT_ADAPTER_DTYPE
from .model_card import (
    BLOCK_START,
    EXPORT_MARK,
    FACTS_PREFIX,
    CardFactsError,
    check_facts,
    read_facts,
    render_plain_lora_block,
    replace_block,
    set_tags,
)

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ADAPTER_WEIGHTS
SAFETENSORS_WEIGHTS, PICKLE_WEIGHTS = ADAPTER_WEIGHTS
README = "README.md"
FASTLORA_ONLY_FIELDS = tuple(sorted({f.name for f in fields(FastLoraConfig)} - {f.name for f in fields(LoraConfig)}))
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
_SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                         "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit

PathLike = Union[str, Path]


class CorruptAdapterError(ValueError):
    """A file of the adapter to export cannot be read, or holds values that are not what ``save_pretrained`` writes."""


def adapter_folder(src_dir: PathLike, subfolder: Optional[str], arg: str = "src_dir") -> Path:
    """The folder holding the adapter's ``adapter_config.json``, with a clear error (naming the argument ``arg``) when
    there is none."""
    root = Path(src_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"`{arg}` {str(root)!r} is not a folder: pass the folder that save_pretrained wrote.")
    src = root / subfolder if subfolder else root
    if not (src / ADAPTER_CONFIG).is_file():
        nested = adapter_subfolders(src) if src.is_dir() else []
        hint = (
            f" It has adapters in the subfolders {nested}: pass one as `subfolder` (`--subfolder` on the command line)."
            if nested
            else " Pass the folder that `save_pretrained` wrote."
        )
        where = f"`subfolder` {subfolder!r} of {str(root)!r}" if subfolder else f"`{arg}` {str(root)!r}"
        raise FileNotFoundError(f"{where} has no {ADAPTER_CONFIG}.{hint}")
    return src


def adapter_subfolders(folder: PathLike) -> list[str]:
    """Names of the subfolders of ``folder`` that hold an adapter (``save_pretrained`` puts every adapter not named
    ``"default"`` in one)."""
    return sorted(p.parent.name for p in Path(folder).glob(f"*/{ADAPTER_CONFIG}"))


def _read_config(src: Path) -> dict:
    path = src / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptAdapterError(f"{str(path)!r} is not valid JSON ({err}): save the adapter again.") from None
    if not isinstance(config, dict):
        raise CorruptAdapterError(
            f"{str(path)!r} holds a JSON {type(config).__name__}, not an object of config fields: save the adapter "
            "again."
        )
    peft_type = config.get("peft_type")
    if peft_type != "FASTLORA":
        extra = " It is a plain LoRA adapter, which stock PEFT loads: nothing to export." if peft_type == "LORA" else ""
        raise ValueError(
            f"{str(src)!r} is not a FastLoRA adapter: its {ADAPTER_CONFIG} has peft_type {peft_type!r}, expected "
            f"'FASTLORA'.{extra}"
        )
    return config


def safetensors_header(path: Path) -> dict:
    """The tensor entries of a safetensors file's header, checked against the file (nothing is loaded).

    Checks what a reader relies on: the header length fits the file, the header is a JSON object, every entry has a
    known dtype, a shape and offsets whose span is exactly the tensor's size, and the entries tile the data section
    to the end of the file (so a truncated file with an intact header is caught).

    Raises:
        `CorruptAdapterError`: naming the file and what is wrong.
    """
    def bad(why: str) -> CorruptAdapterError:
        return CorruptAdapterError(f"{str(path)!r} is not a valid safetensors file: {why}. Save the adapter again.")

    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise bad(f"it has {size} bytes, fewer than the 8-byte header length")
        (length,) = struct.unpack("<Q", f.read(8))
        if not 2 <= length <= min(size - 8, _MAX_HEADER):
            raise bad(f"its header length {length} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise bad(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        ok = isinstance(entry, dict) and entry.get("dtype") in _SAFETENSORS_ITEMSIZE
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not ok:
            raise bad(f"its entry for {name!r} is not {{dtype, shape, data_offsets}}: {entry!r}")
        begin, end = offsets
        if end - begin != math.prod(shape) * _SAFETENSORS_ITEMSIZE[entry["dtype"]] or begin < 0:
            raise bad(f"the offsets {offsets} of {name!r} do not match its shape {shape} and dtype {entry['dtype']}")
        spans.append((begin, end))
    data = size - 8 - length
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise bad(f"its tensors overlap or leave a gap at byte {position} of the data")
        position = end
    if position != data:
        raise bad(f"its header describes {position} bytes of tensor data but the file holds {data} (truncated?)")
    return header


def _read_pickle_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a pickle ``adapter_model.bin``, loaded with ``weights_only=True`` (no code in it runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same thing here
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # torch's text spans many lines
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
        raise CorruptAdapterError(
            f"{str(path)!r} cannot be loaded as a weights-only pickle ({type(err).__name__}: {reason}). The export "
            "writes safetensors only: re-save the adapter with `save_pretrained(..., safe_serialization=True)` (the "
            "default) and export again."
        ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CorruptAdapterError(f"{str(path)!r} does not hold a dict of tensors: save the adapter again.")
    return {k: v.detach().contiguous().clone() for k, v in state.items()}  # clone: safetensors refuses shared memory


def read_source_card(src: Path, root: Path) -> tuple[Optional[ModelCard], Optional[dict]]:
    """The source's card (PEFT writes it in the root folder) and its checked facts."""
    source = next((p for p in (src / README, root / README) if p.is_file()), None)
    if source is None:
        return None, None
    try:
        card = ModelCard.load(source)
        return card, read_facts(card.text)
    except CardFactsError as err:
        raise CorruptAdapterError(
            f"The peft-fastlora facts in {str(source)!r} are not valid: {err}. Restore the card that save_pretrained "
            f"wrote (or save the adapter again), or delete the `{FACTS_PREFIX}... -->` comment to export with a "
            "generic card."
        ) from None
    except Exception as err:  # noqa: BLE001 - huggingface_hub raises several types for a malformed card
        raise CorruptAdapterError(
            f"{str(source)!r} cannot be read as a model card ({type(err).__name__}: {err}): fix or delete it."
        ) from None


def _layer_dtype_counts(stored: dict[str, str]) -> dict[str, int]:
    """``{"bf16": n_layers, ...}`` from the stored tensors' dtypes (one ``lora_A`` per adapted layer)."""
    counts: dict[str, int] = {}
    for name, dtype in stored.items():
        if ".lora_A." in name or ".lora_embedding_A" in name:
            short = _SAFETENSORS_DTYPES.get(dtype, dtype.lower())
            counts[short] = counts.get(short, 0) + 1
    return counts


def _export_facts(facts: dict, config: dict, subfolder: Optional[str], layer_dtypes: dict[str, int]) -> dict:
    """The facts of the export: the exported adapter only, now named "default" at the top of its folder."""
    picked = next((a for a in facts["adapters"] if a["subfolder"] == subfolder), None)
    if picked is None:  # the card was written by a save of other adapters: describe this one from its files
        picked = {"adapter_dtype": config.get("adapter_dtype"), "r": config.get("r"),
                  "lora_alpha": config.get("lora_alpha"), "dtypes": layer_dtypes}
    exported = {**facts, "adapters": [{**picked, "name": "default", "subfolder": None}]}
    try:
        return check_facts(exported)
    except CardFactsError as err:
        raise CorruptAdapterError(f"The adapter's {ADAPTER_CONFIG} holds invalid values: {err}.") from None


def _render_export_card(card: Optional[ModelCard], facts: Optional[dict], config: dict, dtypes: list[str],
                        converted_from: Optional[str]) -> ModelCard:
    card = card or ModelCard.from_template(ModelCardData())
    base = config.get("base_model_name_or_path")
    card.data.library_name = "peft"
    add = {"lora"}
    if base:
        card.data.base_model = card.data.base_model or base
        add.add(f"base_model:adapter:{base}")
    set_tags(card, add, {"fastlora"})
    card.text = replace_block(card.text, render_plain_lora_block(facts, dtypes, converted_from))
    return card


def _is_earlier_export(folder: Path) -> bool:
    """Whether ``folder`` holds a plain LoRA adapter written by [`export_lora`] (config + README section)."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        text = (folder / README).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("peft_type") == "LORA" and BLOCK_START in text \
        and EXPORT_MARK in text


def _check_destination(dst: Path, src: Path, root: Path, overwrite: bool) -> None:
    """Refuses every destination whose files the export would destroy: the source folder, the folder holding it,
    a non-empty folder without ``overwrite``, and, even with it, a folder holding an adapter that is not an earlier
    export (a FastLoRA adapter, a LoRA adapter from elsewhere, adapters in subfolders)."""
    real = dst.resolve()
    if real == src.resolve():
        raise ValueError(f"`dst_dir` {str(dst)!r} is the adapter's own folder: pick a new folder for the export.")
    if real == root.resolve():
        raise ValueError(
            f"`dst_dir` {str(dst)!r} is `src_dir`, the folder holding the adapter of `subfolder` {src.name!r} (and its "
            "default adapter): pick a new folder for the export."
        )
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"`dst_dir` {str(dst)!r} is a file: pick a folder for the export.")
    if not dst.exists() or not any(dst.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"`dst_dir` {str(dst)!r} already exists and is not empty: pick a new folder, or pass `overwrite=True` "
            "(`--overwrite` on the command line) to write into it."
        )
    others = [f"{name}/" for name in adapter_subfolders(dst)]
    if (dst / ADAPTER_CONFIG).is_file() and not _is_earlier_export(dst):
        others.insert(0, "./")
    if others:
        raise FileExistsError(
            f"`dst_dir` {str(dst)!r} holds another adapter (in {others}), and `overwrite=True` (`--overwrite`) only "
            "replaces an earlier export-lora output: pick a new folder, or delete that adapter yourself if you mean to "
            "replace it."
        )


def export_lora(
    src_dir: PathLike, dst_dir: PathLike, *, subfolder: Optional[str] = None, overwrite: bool = False
) -> Path:
    """Writes a plain PEFT ``LORA`` copy of a saved FastLoRA adapter, loadable without peft_fastlora.

    The safetensors weight file is copied byte for byte (a pickle ``adapter_model.bin`` is converted to safetensors,
    loaded with ``weights_only=True``); ``adapter_config.json`` gets ``"peft_type": "LORA"`` and loses the
    FastLoRA-only fields; README.md says how to load the copy with stock PEFT. Every source file is read and checked
    before anything is written, and the files are written beside ``dst_dir`` and then moved into it, so a failure
    leaves ``dst_dir`` as it was.

    Args:
        src_dir (`str` or `Path`): Folder that ``save_pretrained`` wrote the FastLoRA adapter to.
        dst_dir (`str` or `Path`): Folder to write the plain LoRA adapter to.
        subfolder (`str`, *optional*): The adapter's subfolder in ``src_dir`` (``save_pretrained`` puts each adapter
            not named ``"default"`` in a subfolder named after it).
        overwrite (`bool`, defaults to `False`): Write into ``dst_dir`` even if it exists and is not empty. Even then,
            a ``dst_dir`` that holds an adapter other than an earlier export is refused.

    Returns:
        `Path`: ``dst_dir``.

    Raises:
        `FileNotFoundError`, `FileExistsError`, `ValueError` (`CorruptAdapterError` for unreadable source files):
            with a message naming the argument or file, the value and the fix.

    Example:

    ```py
    >>> peft_fastlora.export_lora("out/my-adapter", "out/my-adapter-lora")
    ```
    """
    root, dst = Path(src_dir), Path(dst_dir)
    src = adapter_folder(root, subfolder)
    config = _read_config(src)
    _check_destination(dst, src, root, overwrite)
    converted_from, tensors = None, None
    if (src / SAFETENSORS_WEIGHTS).is_file():  # what PEFT loads when both files exist
        header = safetensors_header(src / SAFETENSORS_WEIGHTS)
        stored = {name: entry["dtype"] for name, entry in header.items()}
    elif (src / PICKLE_WEIGHTS).is_file():
        tensors, converted_from = _read_pickle_weights(src / PICKLE_WEIGHTS), PICKLE_WEIGHTS
        stored = {name: safetensors_dtype_name(t.dtype) for name, t in tensors.items()}
    else:
        raise FileNotFoundError(f"{str(src)!r} has no adapter weights ({' or '.join(WEIGHT_FILES)}).")
    dtypes = sorted({_SAFETENSORS_DTYPES.get(d, d.lower()) for d in stored.values()})
    card, facts = read_source_card(src, root)
    if facts is not None:
        facts = _export_facts(facts, config, subfolder, _layer_dtype_counts(stored))
    card = _render_export_card(card, facts, config, dtypes, converted_from)
    lora_config = {k: v for k, v in config.items() if k not in FASTLORA_ONLY_FIELDS}
    lora_config["peft_type"] = "LORA"

    # Everything is read and checked: now write, beside dst, and move into place (an old .bin in dst goes too).
    with staged_write(dst, supersedes={SAFETENSORS_WEIGHTS: (PICKLE_WEIGHTS,)}) as staging:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2, sort_keys=True) + "\n",
                                              encoding="utf-8")
        if tensors is None:
            shutil.copyfile(src / SAFETENSORS_WEIGHTS, staging / SAFETENSORS_WEIGHTS)
        else:
            save_file(tensors, staging / SAFETENSORS_WEIGHTS, metadata={"format": "pt"})
        card.save(staging / README)
    return dst


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors header name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
    return names.get(dtype, str(dtype).removeprefix("torch.").upper())


def fastlora_config_from_lora(
    lora_config: LoraConfig, adapter_dtype: Optional[str] = None, fp16_overflow_guard: Optional[bool] = None
) -> FastLoraConfig:
    """A [`FastLoraConfig`] with every field of ``lora_config`` plus the given FastLoRA settings.

    ``adapter_dtype`` / ``fp16_overflow_guard`` left at ``None`` keep ``lora_config``'s own when it is a
    ``FastLoraConfig``, else take the defaults (``"fp32-if-fp16"``, ``False``).
    """
    values = {
        f.name: copy.deepcopy(getattr(lora_config, f.name))
        for f in fields(LoraConfig)
        if f.init and f.name != "peft_type" and hasattr(lora_config, f.name)
    }
    if adapter_dtype is None:
        adapter_dtype = getattr(lora_config, "adapter_dtype", DEFAULT_ADAPTER_DTYPE)
    if fp16_overflow_guard is None:
        fp16_overflow_guard = getattr(lora_config, "fp16_overflow_guard", False)
    try:
        return FastLoraConfig(**values, adapter_dtype=adapter_dtype, fp16_overflow_guard=fp16_overflow_guard)
    except ValueError as err:
        raise ValueError(f"This LoRA adapter cannot be loaded into FastLoRA layers: {err}") from err


def _exported_policy(lora_dir: PathLike, subfolder: Optional[str]) -> Optional[str]:
    """The ``adapter_dtype`` policy that an export's card records for its adapter (local folders only), or None."""
    folder = Path(lora_dir) / subfolder if subfolder else Path(lora_dir)
    try:
        facts = read_facts((folder / README).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no local card, or one without valid facts: the caller's default applies
        return None
    return facts["adapters"][0]["adapter_dtype"] if facts and len(facts["adapters"]) == 1 else None


def load_lora_as_fastlora(
    model: torch.nn.Module,
    lora_dir: PathLike,
    adapter_dtype: Optional[str] = None,
    adapter_name: str = "default",
    *,
    fp16_overflow_guard: Optional[bool] = None,
    **kwargs,
) -> PeftModel:
    """Loads a plain PEFT LoRA adapter into FastLoRA layers (to train it further, or to run it faster).

    The adapter's ``LoraConfig`` becomes a [`FastLoraConfig`] with the ``adapter_dtype`` policy; the weights load as
    they are (cast to the policy's dtype). Saving the result writes a FastLoRA adapter; [`export_lora`] turns it back
    into a plain one.

    Args:
        model (`torch.nn.Module`): The base model (quantized or not), or a FastLoRA `PeftModel` to add the adapter to.
        lora_dir (`str` or `Path`): Folder or Hub id of the LoRA adapter.
        adapter_dtype (`str`, *optional*): The FastLoRA adapter dtype policy. By default the adapter's own: the one
            in its config for a FastLoRA adapter, the one its card records for an [`export_lora`] copy in a local
            folder; else `"fp32-if-fp16"`.
        adapter_name (`str`, defaults to `"default"`): Name to give the adapter.
        fp16_overflow_guard (`bool`, *optional*): See [`FastLoraConfig`]; by default a FastLoRA adapter's own, else
            `False`.
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
    if adapter_dtype is None and not isinstance(config, FastLoraConfig):
        adapter_dtype = _exported_policy(lora_dir, kwargs.get("subfolder"))
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
