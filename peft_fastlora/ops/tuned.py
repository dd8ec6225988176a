"""Measured tilings of the fused small-M kernel and the small-M / large-M crossover, per GPU model and shape.

The best tiling of a weight-streaming kernel depends on the GPU (SM count, HBM latency) and on the shape, and a
heuristic misses by up to 1.3x (measured on the H200). ``benchmarks/tune_small_m.py`` sweeps tilings on a GPU and
writes them as JSON; the table shipped in ``configs/small_m.json`` holds the GPUs we measured. A file named by
``PEFT_FASTLORA_SMALL_M_CONFIGS`` is read on top of it (its entries win), so users can tune their own GPU and shapes.

Format (``format: 1``)::

    {"format": 1, "devices": {"<torch.cuda.get_device_name()>": {"kinds": {"nf4" | "int8": {"<N>x<K>": {
        "crossover_m": 16, "configs": {"<M>": {"use_dot": false, "block_n": 8, "block_k": 1024, "split_k": 1,
                                               "num_warps": 4, "num_stages": 1}, ...}}}}}}}

``nf4`` covers every 4-bit weight (FP4 decodes through the same code table). A lookup for M rows takes the entry of
the smallest tabled M >= M (the largest tabled M beyond it). Shapes or GPUs not in the table get ``None`` and the
caller falls back to its heuristic.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

CONFIGS_ENV = "PEFT_FASTLORA_SMALL_M_CONFIGS"
SHIPPED = Path(__file__).with_name("configs") / "small_m.json"
FORMAT = 1
CONFIG_FIELDS = ("use_dot", "block_n", "block_k", "split_k", "num_warps", "num_stages", "factor_scales")


def _read(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot read the small-M tuning table {str(path)!r}: {err}") from err
    if not isinstance(table, dict) or table.get("format") != FORMAT or not isinstance(table.get("devices"), dict):
        raise ValueError(
            f"{str(path)!r} is not a small-M tuning table (expected {{'format': {FORMAT}, 'devices': {{...}}}}); "
            "write one with `python benchmarks/tune_small_m.py --out DIR`."
        )
    return table["devices"]


def merge_tables(base: dict, extra: dict) -> dict:
    """``base`` updated by ``extra`` down to single shapes (a shape in ``extra`` replaces that shape's entry)."""
    merged = json.loads(json.dumps(base))
    for device, entry in extra.items():
        kinds = merged.setdefault(device, {}).setdefault("kinds", {})
        for kind, shapes in entry.get("kinds", {}).items():
            kinds.setdefault(kind, {}).update(shapes)
    return merged


@functools.cache
def _table(env_path: Optional[str]) -> dict:
    table = _read(SHIPPED) if SHIPPED.exists() else {}
    if env_path:
        table = merge_tables(table, _read(Path(env_path)))
    return table


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_table(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return _table(os.environ.get(CONFIGS_ENV)).get(name, {})


def _shape_entry(device_table: dict, kind: str, n: int, k: int) -> dict:
    return device_table.get("kinds", {}).get(kind, {}).get(f"{n}x{k}") or {}


def lookup_config(device_table: dict, kind: str, m: int, n: int, k: int) -> Optional[dict[str, Any]]:
    """The tiling for ``m`` rows in one GPU's table (``{"kinds": ...}``): the entry of the smallest tabled M >= ``m``
    (else the largest); ``None`` when the shape is not tabled or the entry is an M=1 FMA tiling and ``m > 1``."""
    entry = _shape_entry(device_table, kind, n, k)
    configs = {int(key): value for key, value in entry.get("configs", {}).items()}
    if not configs:
        return None
    bucket = min((mm for mm in configs if mm >= m), default=max(configs))
    config = configs[bucket]
    if m > 1 and not config.get("use_dot", True):
        return None
    return {key: config[key] for key in CONFIG_FIELDS if key in config}


def lookup_crossover(device_table: dict, kind: str, n: int, k: int) -> Optional[int]:
    """The tabled crossover M of one GPU's table, or ``None``."""
    value = _shape_entry(device_table, kind, n, k).get("crossover_m")
    return None if value is None else int(value)


def tuned_config(device: torch.device, kind: str, m: int, n: int, k: int) -> Optional[dict[str, Any]]:
    """The measured tiling for ``m`` rows of an ``(n, k)`` weight of ``kind`` (``"nf4"``/``"int8"``), or ``None``."""
    return lookup_config(_device_table(device), kind, m, n, k)


def tuned_crossover(device: torch.device, kind: str, n: int, k: int) -> Optional[int]:
    """The largest M at which the fused small-M kernel measured faster than dequant + cuBLAS, or ``None``."""
    return lookup_crossover(_device_table(device), kind, n, k)
