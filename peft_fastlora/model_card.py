"""The FastLoRA section of an adapter's README.md (model card).

``PeftModel.save_pretrained`` writes PEFT's own card first; then [`update_model_card`] (hooked in by
``_registry.hook_model_card``) adds what someone loading a FastLoRA adapter needs: that ``peft_fastlora`` must be
imported first, how to load the base model exactly as it was quantized, and which dtype the adapter weights are in.
The section lives between marker comments and is replaced on every save, so saving again never duplicates it.

The facts behind the section are also kept, as JSON in a comment inside it, so that ``peft_fastlora.export_lora`` can
write the matching card of a plain LoRA copy from the files alone.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Union

import torch
from huggingface_hub import ModelCard, ModelCardData

from ._atomic import destination_of
from .config import FastLoraConfig
from .dtypes import ADAPTER_DTYPE_POLICIES, FLOAT_DTYPES, model_float_dtype

BLOCK_START = "<!-- peft-fastlora:start -->"
BLOCK_END = "<!-- peft-fastlora:end -->"
FACTS_PREFIX = "<!-- peft-fastlora:facts "
_BLOCK_RE = re.compile(re.escape(BLOCK_START) + r".*?" + re.escape(BLOCK_END) + r"\n?", re.DOTALL)
_FACTS_RE = re.compile(re.escape(FACTS_PREFIX) + r"(\{.*?\}) -->")
EXPORT_MARK = "exported from a FastLoRA adapter"
ADAPTER_PLACEHOLDER = "path/to/this/adapter"
BASE_PLACEHOLDER = "path/to/the/base/model"
SHORT_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
POLICY_TEXT = {
    "bf16": "bf16 adapters whatever the compute dtype (the QLoRA paper's choice).",
    "fp32-if-fp16": "fp32 adapters under fp16 compute (so GradScaler can unscale their gradients), bf16 under bf16 "
    "compute, fp32 under fp32 compute.",
    "fp32": "fp32 adapters whatever the compute dtype.",
}
# task_type -> (AutoPeftModel class, transformers auto class of the base model)
TASK_CLASSES = {
    "CAUSAL_LM": ("AutoPeftModelForCausalLM", "AutoModelForCausalLM"),
    "SEQ_2_SEQ_LM": ("AutoPeftModelForSeq2SeqLM", "AutoModelForSeq2SeqLM"),
    "SEQ_CLS": ("AutoPeftModelForSequenceClassification", "AutoModelForSequenceClassification"),
    "TOKEN_CLS": ("AutoPeftModelForTokenClassification", "AutoModelForTokenClassification"),
    "QUESTION_ANS": ("AutoPeftModelForQuestionAnswering", "AutoModelForQuestionAnswering"),
    "FEATURE_EXTRACTION": ("AutoPeftModelForFeatureExtraction", "AutoModel"),
}


FLOAT_NAMES = ("float16", "bfloat16", "float32")
# bitsandbytes stores packed 4-bit weights in any of these (uint8 by default; a float one for FSDP1).
STORAGE_NAMES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
QUANT_TYPES = ("nf4", "fp4")
_PLAIN = re.compile(r"[^\x00-\x1f\x7f`|]*")  # shown in Markdown code spans and tables: no control chars, ` or |
_WORD = re.compile(r"[A-Za-z0-9_.-]+")


class CardFactsError(ValueError):
    """The facts comment of a model card holds a value that peft-fastlora does not write there."""


def _expect(ok: bool, where: str, value: Any, expected: str) -> None:
    if not ok:
        raise CardFactsError(f"`{where}` is {value!r}, expected {expected}")


def _require_keys(obj: dict, keys: Sequence[str], where: str) -> None:
    missing = [key for key in keys if key not in obj]
    if missing:
        raise CardFactsError(f"`{where}` lacks the field(s) {missing}")


def _check_str(value: Any, where: str, pattern: re.Pattern = _PLAIN, optional: bool = False) -> None:
    if optional and value is None:
        return
    _expect(isinstance(value, str) and pattern.fullmatch(value) is not None, where, value,
            "a string" + (" or null" if optional else "") + f" matching {pattern.pattern!r}")


def _check_choice(value: Any, where: str, choices: Sequence, optional: bool = False) -> None:
    ok = (optional and value is None) or (type(value) in (str, int, bool) and value in choices
                                          and type(value) is type(choices[0]))
    _expect(ok, where, value, f"one of {list(choices)}" + (" or null" if optional else ""))


def _check_quantization(quant: Any) -> None:
    if quant is None:
        return
    _expect(isinstance(quant, dict), "quantization", quant, "an object or null")
    _check_str(quant.get("method"), "quantization.method", _WORD)
    if quant["method"] != "bitsandbytes":
        return
    _require_keys(quant, ("bits", "skip_modules"), "quantization")
    _check_choice(quant.get("bits"), "quantization.bits", (4, 8))
    skip = quant.get("skip_modules")
    _expect(skip is None or (isinstance(skip, list) and all(isinstance(m, str) for m in skip)),
            "quantization.skip_modules", skip, "a list of strings or null")
    if quant["bits"] == 4:
        _require_keys(quant, ("quant_type", "compute_dtype", "double_quant", "quant_storage"), "quantization")
        _check_choice(quant.get("quant_type"), "quantization.quant_type", QUANT_TYPES)
        _check_choice(quant.get("compute_dtype"), "quantization.compute_dtype", FLOAT_NAMES)
        _check_choice(quant.get("double_quant"), "quantization.double_quant", (True, False))
        _check_choice(quant.get("quant_storage"), "quantization.quant_storage", STORAGE_NAMES)


def check_facts(facts: Any) -> dict:
    """Checks every field of card facts against the values [`collect_card_facts`] writes; returns ``facts``.

    The facts of a card downloaded from the Hub are untrusted: their values end up in Python snippets and Markdown,
    so anything else (a dtype that is not a dtype name, a flag that is not a bool, a string with a backtick) is
    refused rather than rendered.

    Raises:
        `CardFactsError` (a `ValueError`): naming the field, its value and what was expected.
    """
    _expect(isinstance(facts, dict), "facts", facts, "an object")
    _require_keys(facts, ("base_model", "model_dtype", "task_type", "quantization", "adapters"), "facts")
    _check_str(facts.get("base_model"), "base_model", optional=True)
    _check_choice(facts.get("model_dtype"), "model_dtype", FLOAT_NAMES, optional=True)
    _check_str(facts.get("task_type"), "task_type", _WORD, optional=True)
    _check_quantization(facts.get("quantization"))
    adapters = facts.get("adapters")
    _expect(isinstance(adapters, list) and len(adapters) > 0, "adapters", adapters, "a non-empty list")
    for i, adapter in enumerate(adapters):
        where = f"adapters[{i}]"
        _expect(isinstance(adapter, dict), where, adapter, "an object")
        _require_keys(adapter, ("name", "subfolder", "adapter_dtype", "dtypes", "r", "lora_alpha"), where)
        _check_str(adapter.get("name"), f"{where}.name")
        _check_str(adapter.get("subfolder"), f"{where}.subfolder", optional=True)
        _check_choice(adapter.get("adapter_dtype"), f"{where}.adapter_dtype", ADAPTER_DTYPE_POLICIES)
        dtypes = adapter.get("dtypes")
        _expect(isinstance(dtypes, dict) and all(_WORD.fullmatch(str(k)) and type(n) is int for k, n in dtypes.items()),
                f"{where}.dtypes", dtypes, "an object of dtype name -> layer count")
        for key in ("r", "lora_alpha"):
            value = adapter.get(key)
            _expect(type(value) in (int, float) and value > 0, f"{where}.{key}", value, "a positive number")
    return facts


def _torch_dtype(name: str, allowed: Sequence[str]) -> str:
    """``torch.<name>`` for a checked dtype name: the only way a dtype from the facts reaches the snippets."""
    if name not in allowed:
        raise CardFactsError(f"{name!r} is not one of {list(allowed)}")
    return f"torch.{name}"


def install_commands() -> str:
    """The card's install commands: from PyPI, and from the source until the package is released there.

    With a ``Source``/``Repository`` project URL in the installed package's metadata, the source line installs from
    it; otherwise it names the folder of a checkout.
    """
    urls = {}
    try:
        for entry in metadata.metadata("peft-fastlora").get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            urls[label.strip().lower()] = url.strip()
    except metadata.PackageNotFoundError:
        pass
    url = next((urls[k] for k in ("source", "repository", "homepage") if k in urls), None)
    if url and re.fullmatch(r"https://[A-Za-z0-9./_-]+", url):
        source = f'pip install "peft-fastlora @ git+{url}"'
    else:
        source = "pip install ./peft-fastlora  # the folder of a peft-fastlora checkout (it holds pyproject.toml)"
    return f"# peft-fastlora is not on PyPI yet: install it from its source\n{source}\n" \
           "# once it is released there: pip install peft-fastlora"


def _py(value: Any) -> str:
    """A Python literal for a str or a list of str, in double quotes (JSON's quoting is valid Python for these)."""
    return json.dumps(value)


def _dtype_name(dtype: Any) -> Optional[str]:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; ``None`` stays ``None``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


# ---- facts ---------------------------------------------------------------------------------------------------------
def quantization_facts(base_model: torch.nn.Module) -> Optional[dict]:
    """How the base model is quantized, as a JSON-able dict, or ``None`` when it is not.

    Read from ``model.config.quantization_config`` when present, else from the bitsandbytes layers themselves.
    """
    config = getattr(getattr(base_model, "config", None), "quantization_config", None)
    if config is not None:
        config = config if isinstance(config, dict) else config.to_dict()
        method = str(getattr(config.get("quant_method"), "value", config.get("quant_method", "bitsandbytes")))
        if method != "bitsandbytes":
            return {"method": method}
        skip = config.get("llm_int8_skip_modules")
        if config.get("load_in_4bit"):
            return {
                "method": "bitsandbytes",
                "bits": 4,
                "quant_type": config.get("bnb_4bit_quant_type", "fp4"),
                "compute_dtype": _dtype_name(config.get("bnb_4bit_compute_dtype") or "float32"),
                "double_quant": bool(config.get("bnb_4bit_use_double_quant", False)),
                "quant_storage": _dtype_name(config.get("bnb_4bit_quant_storage") or "uint8"),
                "skip_modules": skip,
            }
        if config.get("load_in_8bit"):
            return {"method": "bitsandbytes", "bits": 8, "skip_modules": skip}
    import bitsandbytes as bnb

    for module in base_model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module.weight, "quant_state", None) is not None:
            state = module.weight.quant_state
            return {
                "method": "bitsandbytes",
                "bits": 4,
                "quant_type": state.quant_type,
                "compute_dtype": _dtype_name(module.compute_dtype or torch.float32),
                "double_quant": bool(state.nested),
                "quant_storage": _dtype_name(getattr(module.weight, "quant_storage", torch.uint8)),
                "skip_modules": None,
            }
        if isinstance(module, bnb.nn.Linear8bitLt) and not module.state.has_fp16_weights:
            return {"method": "bitsandbytes", "bits": 8, "skip_modules": None}
    return None


def adapter_dtype_counts(model: torch.nn.Module, adapter_name: str) -> dict[str, int]:
    """``{"bf16": n_layers, ...}``: the dtypes the adapter's weights actually have (so will be saved in)."""
    from peft.tuners.lora import LoraLayer

    counts: dict[str, int] = {}
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for attr in ("lora_A", "lora_embedding_A"):
            container = getattr(module, attr, None)
            if container is not None and adapter_name in container:
                item = container[adapter_name]
                dtype = item.dtype if isinstance(item, torch.Tensor) else next(item.parameters()).dtype
                name = SHORT_DTYPE.get(dtype, _dtype_name(dtype))
                counts[name] = counts.get(name, 0) + 1
                break
    return counts


def collect_card_facts(peft_model, adapter_names: Optional[Sequence[str]] = None) -> Optional[dict]:
    """Everything the FastLoRA card section says, as a JSON-able dict; ``None`` if no adapter is a FastLoRA one.

    Args:
        peft_model (`peft.PeftModel`): The model being saved.
        adapter_names (`Sequence[str]`, *optional*): The adapters being saved (default: all of the model's).
    """
    configs = {
        name: cfg
        for name, cfg in peft_model.peft_config.items()
        if isinstance(cfg, FastLoraConfig) and (adapter_names is None or name in adapter_names)
    }
    if not configs:
        return None
    base_model = peft_model.get_base_model()
    base_name = getattr(base_model, "name_or_path", None) or next(
        (c.base_model_name_or_path for c in configs.values() if c.base_model_name_or_path), None
    )
    model_dtype = model_float_dtype(base_model)
    task_type = next((c.task_type for c in configs.values() if c.task_type), None)
    adapters = [
        {
            "name": name,
            "subfolder": None if name == "default" else name,
            "adapter_dtype": cfg.adapter_dtype,
            "dtypes": adapter_dtype_counts(peft_model, name),
            "r": cfg.r,
            "lora_alpha": cfg.lora_alpha,
        }
        for name, cfg in configs.items()
    ]
    # The default adapter first: it is the one that PeftModel.from_pretrained loads without a subfolder.
    adapters.sort(key=lambda a: a["subfolder"] is not None)
    return {
        "base_model": base_name,
        "model_dtype": _dtype_name(model_dtype) if model_dtype in FLOAT_DTYPES else None,
        "task_type": str(getattr(task_type, "value", task_type)) if task_type else None,
        "quantization": quantization_facts(base_model),
        "adapters": adapters,
    }


def read_facts(text: str) -> Optional[dict]:
    """The facts embedded in a card text by [`update_model_card`], checked by [`check_facts`]; ``None`` if absent.

    Raises:
        `CardFactsError` (a `ValueError`): The facts comment is there but is not valid JSON or fails [`check_facts`].
    """
    match = _FACTS_RE.search(text)
    if not match:
        return None
    try:
        facts = json.loads(match.group(1))
    except json.JSONDecodeError as err:
        raise CardFactsError(f"the facts comment is not valid JSON ({err})") from None
    return check_facts(facts)


# ---- rendering -----------------------------------------------------------------------------------------------------
def quantization_config_code(quant: Optional[dict]) -> Optional[str]:
    """Python source building the ``BitsAndBytesConfig`` that reproduces the base model's quantization."""
    if not quant or quant.get("method") != "bitsandbytes":
        return None
    skip = f"    llm_int8_skip_modules={_py(quant['skip_modules'])},\n" if quant.get("skip_modules") else ""
    if quant["bits"] == 8:
        return f"quantization_config = BitsAndBytesConfig(\n    load_in_8bit=True,\n{skip})"
    return (
        "quantization_config = BitsAndBytesConfig(\n"
        "    load_in_4bit=True,\n"
        f"    bnb_4bit_quant_type={_py(quant['quant_type'])},\n"
        f"    bnb_4bit_compute_dtype={_torch_dtype(quant['compute_dtype'], FLOAT_NAMES)},\n"
        f"    bnb_4bit_use_double_quant={quant['double_quant'] is True!r},\n"
        f"    bnb_4bit_quant_storage={_torch_dtype(quant['quant_storage'], STORAGE_NAMES)},\n"
        f"{skip})"
    )


def describe_quantization(facts: dict) -> str:
    """One line describing the base model's quantization."""
    quant, model_dtype = facts.get("quantization"), facts.get("model_dtype")
    if not quant:
        return f"not quantized ({model_dtype or 'unknown dtype'})"
    if quant.get("method") != "bitsandbytes":
        return f"quantized with `{quant['method']}` (see the base model's config)"
    if quant["bits"] == 8:
        return f"bitsandbytes 8-bit (int8, row-wise scales), compute dtype {model_dtype} (the model dtype)"
    double = "yes" if quant["double_quant"] else "no"
    return (
        f"bitsandbytes 4-bit {quant['quant_type']}, compute dtype {quant['compute_dtype']}, double quantization: "
        f"{double}, quant_storage: {quant['quant_storage']}"
    )


def usage_code(facts: dict, *, plugin: bool) -> str:
    """A runnable snippet that loads the base model as it was quantized, then every adapter of ``facts``."""
    check_facts(facts)
    task = TASK_CLASSES.get(facts.get("task_type") or "")
    auto_class = task[1] if task else "AutoModel"
    quant_code = quantization_config_code(facts.get("quantization"))
    model_dtype = facts.get("model_dtype")
    lines = ["import torch"] if quant_code or model_dtype else []
    lines += ["from peft import PeftModel"]
    lines += [f"from transformers import {auto_class}" + (", BitsAndBytesConfig" if quant_code else "")]
    if plugin:
        lines += ["", "import peft_fastlora  # noqa: F401  (registers FastLoRA with PEFT: import it before loading)"]
    lines += ["", f'adapter = "{ADAPTER_PLACEHOLDER}"  # this repository\'s id on the Hub, or the folder it is in']
    load_kwargs = ""
    if quant_code:
        lines.append(quant_code)
        load_kwargs += ", quantization_config=quantization_config"
    if model_dtype:
        load_kwargs += f", dtype={_torch_dtype(model_dtype, FLOAT_NAMES)}"
    base_model = _py(facts.get("base_model") or BASE_PLACEHOLDER)
    lines.append(f"base = {auto_class}.from_pretrained({base_model}{load_kwargs})")
    for i, adapter in enumerate(facts["adapters"]):
        sub = adapter["subfolder"]
        where = f", adapter_name={_py(adapter['name'])}, subfolder={_py(sub)}" if sub else ""
        if i == 0:
            lines.append(f"model = PeftModel.from_pretrained(base, adapter{where})")
        else:
            lines.append(f"model.load_adapter(adapter{where})")
    code = "\n".join(lines)
    if task and facts["adapters"][0]["subfolder"] is None:
        code += (
            f"\n\n# or, in one call (the default adapter):\n# from peft import {task[0]}\n"
            f"# model = {task[0]}.from_pretrained(adapter{load_kwargs})"
        )
    return code


def _dtypes_text(counts: dict[str, int]) -> str:
    if len(counts) <= 1:
        return next(iter(counts), "-")
    return ", ".join(f"{dtype} ({n} layer{'s' if n > 1 else ''})" for dtype, n in sorted(counts.items()))


def _facts_comment(facts: dict) -> str:
    # ">" is escaped so that no string in the JSON can close the HTML comment early.
    return FACTS_PREFIX + json.dumps(facts, sort_keys=True).replace(">", "\\u003e") + " -->"


def render_fastlora_block(facts: dict) -> str:
    """The marked "Using this adapter" section of a FastLoRA adapter's card."""
    rows = "\n".join(
        f"| {a['name']} | `{a['subfolder'] or '.'}` | `{a['adapter_dtype']}` | {_dtypes_text(a['dtypes'])} "
        f"| {a['r']} | {a['lora_alpha']} |"
        for a in facts["adapters"]
    )
    policies = "\n".join(
        f"- `{p}`: {POLICY_TEXT[p]}" for p in sorted({a["adapter_dtype"] for a in facts["adapters"]})
    )
    subfolder_hint = " (add `--subfolder NAME` for an adapter in a subfolder)" if len(facts["adapters"]) > 1 else ""
    return f"""{BLOCK_START}
{_facts_comment(facts)}

## Using this adapter

This is a FastLoRA adapter, trained with `peft-fastlora`, a PEFT plugin for fast, dtype-safe QLoRA. Its weights have
LoRA's names and format, but its `adapter_config.json` says `"peft_type": "FASTLORA"`, so PEFT needs the plugin to
load it: install it and `import peft_fastlora` before loading (without it, PEFT fails with `KeyError: 'FASTLORA'`).

```bash
{install_commands()}
```

```python
{usage_code(facts, plugin=True)}
```

Without peft-fastlora (stock PEFT, vLLM and other LoRA consumers), export a plain LoRA copy first:
`python -m peft_fastlora export-lora <this folder> <new folder>`{subfolder_hint}. For a plain 16-bit checkpoint with
the adapter merged in (losslessly, into the dequantized base): `python -m peft_fastlora merge <base model> <this folder>
<new folder>`.

### Adapter dtypes

| adapter | folder | `adapter_dtype` policy | dtype used | r | lora_alpha |
|---|---|---|---|---|---|
{rows}

{policies}

### Base model

- Base model: `{facts.get("base_model")}`
- Quantization: {describe_quantization(facts)}
{BLOCK_END}
"""


def render_plain_lora_block(
    facts: Optional[dict], tensor_dtypes: list[str], converted_from: Optional[str] = None
) -> str:
    """The marked "Using this adapter" section of a plain LoRA export (see ``peft_fastlora.export_lora``).

    ``converted_from`` names the pickle weight file that the export converted to safetensors, if it did.
    """
    stored = ", ".join(tensor_dtypes) or "-"
    if converted_from:
        weights = f"The weights are the FastLoRA adapter's, converted from `{converted_from}` to safetensors " \
                  f"(same values, stored as {stored})."
    else:
        weights = f"The weights are the FastLoRA adapter's, byte for byte (stored as {stored})."
    if facts:
        base = f"""```python
{usage_code(facts, plugin=False)}
```

- Base model: `{facts.get("base_model")}`
- Quantization during training: {describe_quantization(facts)}"""
    else:
        base = "Load the base model as it was loaded for training (same quantization), then the adapter with " \
               "`PeftModel.from_pretrained(base, adapter)`."
    # The facts travel with the export (as in the FastLoRA card): load_lora_as_fastlora reads the adapter_dtype policy
    # back from them, and export-lora --overwrite recognises an earlier export by them.
    facts_line = f"\n{_facts_comment(facts)}" if facts else ""
    return f"""{BLOCK_START}{facts_line}

## Using this adapter

A plain PEFT LoRA adapter (`"peft_type": "LORA"`), {EXPORT_MARK} with
`python -m peft_fastlora export-lora`: stock PEFT loads it without peft-fastlora, and so do other LoRA consumers such
as vLLM. {weights}

{base}

To train it further with FastLoRA layers: `peft_fastlora.load_lora_as_fastlora(base, adapter)`.
{BLOCK_END}
"""


# ---- the card file -------------------------------------------------------------------------------------------------
def replace_block(text: str, block: Optional[str]) -> str:
    """``text`` with its marked section replaced by ``block`` (inserted after the title if absent; removed if None)."""
    match = _BLOCK_RE.search(text)
    text = _BLOCK_RE.sub("", text)  # every copy goes; one is put back below
    if block is None:
        return text
    if match:
        at = match.start()
    else:
        title = re.search(r"^# .*\n", text, re.MULTILINE)
        at = title.end() if title else 0
        block = "\n" + block
    return text[:at] + block + text[at:]


def set_tags(card: ModelCard, add: set[str], remove: set[str]) -> None:
    tags = set(card.data.tags or []) - remove | add
    card.data.tags = sorted(tags)


def write_fastlora_card(readme: Union[str, Path], facts: dict) -> None:
    """Adds (or replaces) the FastLoRA section and tags of the card at ``readme`` (created if missing)."""
    readme = Path(readme)
    card = ModelCard.load(readme) if readme.exists() else ModelCard.from_template(ModelCardData())
    card.data.library_name = "peft"
    base = facts.get("base_model")
    add = {"fastlora", "lora"}
    if base:
        card.data.base_model = card.data.base_model or base
        add.add(f"base_model:adapter:{base}")
    quantized = bool(facts.get("quantization"))
    set_tags(card, add | ({"qlora"} if quantized else set()), set() if quantized else {"qlora"})
    card.text = replace_block(card.text, render_fastlora_block(facts))
    card.save(readme)


def update_model_card(
    peft_model, output_dir: Union[str, Path], adapter_names: Optional[Sequence[str]] = None
) -> None:
    """Adds the FastLoRA section to the README.md that ``PeftModel.save_pretrained`` just wrote in ``output_dir``.

    Does nothing for a model without FastLoRA adapters, except removing a FastLoRA section left by an earlier save
    to the same folder (it would no longer be true). A failure only warns: it must not stop the adapter from being
    saved.

    Args:
        peft_model (`peft.PeftModel`): The model being saved.
        output_dir (`str` or `Path`): The folder it is saved to.
        adapter_names (`Sequence[str]`, *optional*): The adapters being saved (``save_pretrained``'s
            ``selected_adapters``); default: all of the model's.
    """
    readme = Path(output_dir) / "README.md"
    try:
        facts = collect_card_facts(peft_model, adapter_names)
        if facts is not None:
            write_fastlora_card(readme, facts)
        elif readme.exists() and BLOCK_START in readme.read_text(encoding="utf-8"):
            card = ModelCard.load(readme)
            card.text = replace_block(card.text, None)
            set_tags(card, set(), {"fastlora"})
            card.save(readme)
    except Exception as err:  # the card is a courtesy: the adapter files matter more
        shown = destination_of(output_dir) / "README.md"  # the save writes through a staging folder
        warnings.warn(f"peft_fastlora could not update the model card {shown}: {err!r}", stacklevel=2)
