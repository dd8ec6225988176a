"""The small-M tuning table: its format (read, validate, merge, write) and the lookups the launcher makes.

The best tiling of a weight-streaming kernel depends on the GPU (SM count, HBM latency) and on the shape, and a
heuristic misses by up to 1.3x (measured on the H200). ``benchmarks/tune_small_m.py`` sweeps tilings on a GPU and
writes a table with the functions here; the table shipped in ``ops/configs/small_m.json`` holds the GPUs we
measured. A file named by ``PEFT_FASTLORA_SMALL_M_CONFIGS`` is read on top of it (its shapes win), so users can tune
their own GPU and shapes.

Format (``format: 1``)::

    {"format": 1, "devices": {"<torch.cuda.get_device_name()>": {"torch": ..., "triton": ..., "date": "YYYY-MM-DD",
        "kinds": {"nf4" | "int8": {"<N>x<K>": {"crossover_m": 16, "configs": {"<M>": {"use_dot": false,
            "block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "num_stages": 1}, ...}}}}}}}

``nf4`` covers every 4-bit weight (FP4 decodes through the same code table). Each config holds the fields of
[`SmallMConfig`] (``factor_scales``, ``block_m`` and ``packed_dot`` only where they are not the default). A lookup
for M rows takes the entry of the smallest tabled M >= M (the largest tabled M beyond it). Shapes or GPUs not in the
table get ``None`` and the launcher falls back to its heuristic.

Caching: the merged table is read once per value of ``PEFT_FASTLORA_SMALL_M_CONFIGS`` (``_merged_devices``) and GPU
names once per device index; both are keyed by everything they read, so nothing needs invalidating while the
process runs (a changed file is read by a new process).

This module imports no Triton: the tuner script and CPU tests use it as is.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch

CONFIGS_ENV = "PEFT_FASTLORA_SMALL_M_CONFIGS"
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "small_m.json"
FORMAT = 1
KINDS = ("nf4", "int8")
BLOCK_MS = (16, 32, 64)  # rows per tensor-core program (SmallMConfig.block_m)


@dataclass(frozen=True)
class SmallMConfig:
    """Tiling of one small-M launch. ``use_dot``: tensor-core path (``block_m`` rows per program) instead of FMAs (one
    row).

    ``split_k`` is what the launcher is asked for; it drops empty splits (see [`effective_split_k`]).
    """

    use_dot: bool
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    # 1 = no software pipelining: with more stages Triton's pipeliner also routes the per-element code-table
    # gathers through shared memory (cp.async), which costs more than the latency it hides here. On the M = 1
    # factor_scales path (no gathers), > 1 stages its tiles through shared memory this many deep instead of the
    # kernel's register prefetch (LOAD_STAGES; the tuner tries it with --m1-stages).
    num_stages: int = 1
    # M = 1 with 4-bit rows of whole absmax blocks: sum code * x over each block, then multiply by the block's scale
    # once (instead of scaling and rounding every weight). About half the instructions per weight; W is then not
    # rounded to x.dtype before the multiply (more accurate than the reference, within the same tolerances).
    factor_scales: bool = True
    # Tensor-core path: rows per program (the MMA's second side). Each program decodes its weight tile once for its
    # rows, so rows beyond block_m decode the weight again: 32 or 64 keep 17-64 rows to one decode of W.
    block_m: int = 16
    # With factor_scales on bf16 rows (compiled kernels): decode by byte permutes and sum each word's products in
    # packed bf16 FMAs (small_m_kernel.py, PACKED_DOT); codes and per-word partial sums are rounded to bf16.
    packed_dot: bool = False

    def __post_init__(self) -> None:
        # Configs may come from a user's JSON file: reject what the kernel cannot tile, naming the field.
        for name, low in (("block_n", 1), ("block_k", 16), ("num_warps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"SmallMConfig `{name}` must be a power of two >= {low}, got {value!r}.")
        for name in ("split_k", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SmallMConfig `{name}` must be an int >= 1, got {value!r}.")
        for name in ("use_dot", "factor_scales", "packed_dot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SmallMConfig `{name}` must be true or false, got {getattr(self, name)!r}.")
        if self.block_m not in BLOCK_MS or type(self.block_m) is not int:
            raise ValueError(f"SmallMConfig `block_m` must be one of {BLOCK_MS}, got {self.block_m!r}.")

    @property
    def rows_per_program(self) -> int:
        """``BLOCK_M`` of the launch: ``block_m`` on tensor cores, one row on the CUDA-core path."""
        return self.block_m if self.use_dot else 1

    def to_json(self) -> dict[str, Any]:
        """The table entry: every field, ``factor_scales``, ``block_m`` and ``packed_dot`` only where they differ from
        their defaults (tables written before ``block_m`` existed read the same)."""
        entry = asdict(self)
        for name, default in _OMITTED_DEFAULTS.items():
            if entry[name] == default:
                del entry[name]
        return entry

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> SmallMConfig:
        unknown = set(entry) - set(CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"Unknown small-M config field(s) {sorted(unknown)}; the fields are {CONFIG_FIELDS}.")
        return cls(**entry)


CONFIG_FIELDS = tuple(f.name for f in fields(SmallMConfig))
_OMITTED_DEFAULTS = {
    name: SmallMConfig.__dataclass_fields__[name].default for name in ("factor_scales", "block_m", "packed_dot")
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def effective_split_k(k: int, block_k: int, split_k: int) -> int:
    """The split count the launcher runs for ``split_k``: it drops empty splits (8 asked on 14 K-tiles runs 7)."""
    k_per_split = _cdiv(_cdiv(k, block_k), split_k) * block_k
    return _cdiv(k, k_per_split)


def shape_key(n: int, k: int) -> str:
    """The table key of an ``(out_features, in_features)`` shape."""
    return f"{n}x{k}"


def empty_table() -> dict:
    return {"format": FORMAT, "devices": {}}


def check_table(table: Any, source: str) -> dict:
    """Returns ``table`` if it is a valid format-1 table, else raises a ``ValueError`` naming ``source`` and the
    first bad entry."""
    if not isinstance(table, dict) or table.get("format") != FORMAT or not isinstance(table.get("devices"), dict):
        raise ValueError(
            f"{source} is not a small-M tuning table (expected {{'format': {FORMAT}, 'devices': {{...}}}}); "
            "write one with `python benchmarks/tune_small_m.py --out DIR`."
        )
    for device, entry in table["devices"].items():
        for kind, shapes in (entry.get("kinds") or {}).items():
            for shape, shape_entry in shapes.items():
                where = f"{source}: {device} / {kind} / {shape}"
                if kind not in KINDS:
                    raise ValueError(f"{where}: the kind must be one of {KINDS}.")
                crossover = shape_entry.get("crossover_m")
                if crossover is not None and (not isinstance(crossover, int) or crossover < 0):
                    raise ValueError(f"{where}: `crossover_m` must be an int >= 0, got {crossover!r}.")
                for m, config in (shape_entry.get("configs") or {}).items():
                    if not str(m).isdigit() or int(m) < 1:
                        raise ValueError(f"{where}: config keys are row counts M >= 1, got {m!r}.")
                    try:
                        SmallMConfig.from_json(config)
                    except (TypeError, ValueError) as err:
                        raise ValueError(f"{where} / M={m}: {err}") from err
    return table


def read_table(path: os.PathLike | str) -> dict:
    """Reads and validates the table at ``path``."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot read the small-M tuning table {str(path)!r}: {err}") from err
    return check_table(table, repr(str(path)))


def merge_tables(base: dict, new: dict) -> dict:
    """``base`` updated by ``new``: a device's torch/triton/date come from ``new``; a shape in ``new`` replaces that
    (device, kind, shape) entry; every other device, kind and shape of ``base`` is kept. Neither input changes."""
    merged = json.loads(json.dumps(check_table(base, "the base table")))
    for device, entry in check_table(new, "the new table")["devices"].items():
        target = merged["devices"].setdefault(device, {})
        target.update({key: value for key, value in entry.items() if key != "kinds"})
        kinds = target.setdefault("kinds", {})
        for kind, shapes in (entry.get("kinds") or {}).items():
            kinds.setdefault(kind, {}).update(json.loads(json.dumps(shapes)))
    return merged


def dumps_table(obj: Any, level: int = 0) -> str:
    """JSON with one line per config (a dict without nested dicts is written inline): short, readable diffs."""
    if not isinstance(obj, dict) or not any(isinstance(v, dict) for v in obj.values()):
        return json.dumps(obj)
    pad = "  " * (level + 1)
    items = [f"{pad}{json.dumps(str(key))}: {dumps_table(value, level + 1)}" for key, value in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"


def write_table(path: os.PathLike | str, table: dict) -> None:
    """Validates ``table`` and writes it to ``path`` through a temporary sibling and a rename: a failure leaves any
    previous file as it was."""
    path = Path(path)
    text = dumps_table(check_table(table, "the table to write")) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _shape_entry(device_table: dict, kind: str, n: int, k: int) -> dict:
    return (device_table.get("kinds") or {}).get(kind, {}).get(shape_key(n, k)) or {}


def lookup_config(device_table: dict, kind: str, m: int, n: int, k: int) -> Optional[SmallMConfig]:
    """The tiling for ``m`` rows in one GPU's table (``{"kinds": ...}``): the entry of the smallest tabled M >= ``m``
    (else the largest); ``None`` when the shape is not tabled or the entry is an M=1 FMA tiling and ``m > 1``."""
    configs = {int(key): value for key, value in (_shape_entry(device_table, kind, n, k).get("configs") or {}).items()}
    if not configs:
        return None
    config = SmallMConfig.from_json(configs[min((mm for mm in configs if mm >= m), default=max(configs))])
    return None if m > 1 and not config.use_dot else config


def lookup_crossover(device_table: dict, kind: str, n: int, k: int) -> Optional[int]:
    """The tabled crossover M of one GPU's table, or ``None``."""
    value = _shape_entry(device_table, kind, n, k).get("crossover_m")
    return None if value is None else int(value)


@functools.cache
def _merged_devices(env_path: Optional[str]) -> dict:
    table = read_table(SHIPPED) if SHIPPED.exists() else empty_table()
    if env_path:
        table = merge_tables(table, read_table(env_path))
    return table["devices"]


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_table(device: torch.device) -> dict:
    """The merged table's entry for ``device``'s GPU model (``{}`` off CUDA or for an untabled GPU)."""
    if device.type != "cuda":
        return {}
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return _merged_devices(os.environ.get(CONFIGS_ENV)).get(name, {})


def tuned_config(device: torch.device, kind: str, m: int, n: int, k: int) -> Optional[SmallMConfig]:
    """The measured tiling for ``m`` rows of an ``(n, k)`` weight of ``kind`` (``"nf4"``/``"int8"``), or ``None``."""
    return lookup_config(device_table(device), kind, m, n, k)


def tuned_crossover(device: torch.device, kind: str, n: int, k: int) -> Optional[int]:
    """The largest M at which the fused small-M kernel measured faster than dequant + cuBLAS, or ``None``."""
    return lookup_crossover(device_table(device), kind, n, k)
