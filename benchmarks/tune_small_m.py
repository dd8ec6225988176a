"""Tunes the fused small-M (decode) kernel per GPU and shape, and measures where it stops beating dequant + cuBLAS.

For each weight kind (nf4 with double quant and blocksize 64; int8), shape ``N x K`` and row count M, on bf16
activations with an r=16 LoRA (random A and B):

1. candidate tilings (``SmallMConfig``) of ``peft_fastlora.ops.kernels.small_m`` are checked once against
   ``lora_linear_ref`` (a wrong one is reported and can never win), then timed;
2. the fastest three are re-timed; the winner, the heuristic default, the large-M path (``lora_linear_forward``:
   dequantize + cuBLAS) and PEFT's LoRA on bitsandbytes layers (bnb's kernels, gemv at M=1) are timed as forwards;
3. crossover per (kind, shape): the largest M of the grid at which the fused forward beats the large-M path at that
   M and at every smaller M of the grid (0: it never does).

Timing, as in bench_layers.py's kernels section: every op cycles over enough weight copies to defeat the L2, all
captured in one CUDA graph; us per call = replay time / calls. The fused forward is one launch (plus the memset of
its counters); the LoRA down-projection ``x @ A.T`` is made inside it.

Search. Compiling is what costs: Triton builds one binary per tiling (split_k included; shapes are not constexprs).
  pass 1  M=1: FMA tilings and a few tensor-core ones; M=16: tensor-core tilings. Tiles hold 16-64 weight elements
          per thread; per tile, the split_k values whose program count is nearest ~24/num_warps programs per SM.
  pass 2  the other Ms, ascending, until the fused path loses: the best tilings of M=16 (split_k rescaled to keep
          the program count when M > 16 adds row tiles) and the default.
  pass 3  Ms past the crossover (for the plot), while time is left.
Before passes 1 and 2 worker processes (--compile-workers) compile the pass's tilings into Triton's on-disk cache.
At --time-budget seconds (counted from the start, imports and compiles included) the sweep stops and what was
measured is written.

Outputs in --out: tune_small_m.csv (one row per kind/shape/M), tune_candidates.csv (every tiling tried),
tune_small_m.png (us vs M per shape) and small_m_configs.json, the table whose format
``peft_fastlora/ops/kernels/tuning.py`` owns (this script reads, merges and writes it with those functions)::

    {"format": 1, "devices": {"<torch.cuda.get_device_name()>": {"torch": ..., "triton": ..., "date": "YYYY-MM-DD",
        "kinds": {"nf4" | "int8": {"<N>x<K>": {"crossover_m": 16, "configs": {"<M>": {"use_dot": false,
            "block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "num_stages": 1}, ...}}}}}}}

("nf4" covers every 4-bit weight.) ``--merge FILE`` merges this run into FILE (other devices and shapes kept; a
measured shape replaces its entry) and writes the merged table to --out too.

    python benchmarks/tune_small_m.py --out benchmarks/results/tune      # ~2-3 min on one H100/H200, <= 240 s
    python benchmarks/tune_small_m.py --model-config /path/to/model --merge my_small_m.json  # a model's shapes
    python benchmarks/tune_small_m.py --plan                             # grid sizes only, no GPU
    python benchmarks/tune_small_m.py --from-json DIR/small_m_configs.json \
        --merge peft_fastlora/ops/configs/small_m.json                   # merge tables, no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin TimeoutError before Python 3.11
from pathlib import Path
from typing import Optional

_T0 = time.monotonic()  # the time budget counts from here

import _common as C  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402

from peft_fastlora.ops.kernels.tuning import (  # noqa: E402
    BLOCK_MS,
    CONFIG_FIELDS,
    SmallMConfig,
    effective_split_k,
    empty_table,
    merge_tables,
    read_table,
    shape_key,
)
from peft_fastlora.ops.kernels.tuning import FORMAT as TABLE_FORMAT  # noqa: E402
from peft_fastlora.ops.kernels.tuning import write_table as _write_table  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K) = (out_features, in_features) of Llama-3-8B
KINDS = ("nf4", "int8")
MS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
PASS1_MS = (1, 16)
RANK, SCALING = 16, 2.0  # lora_alpha = 2 r
JSON_NAME = "small_m_configs.json"

# Candidate grid. A program holds a (BLOCK_N, BLOCK_K) weight tile (and prefetches the next): 16-64 elements per
# thread keeps registers low enough for several programs per SM, which is what keeps bytes in flight. The M=1 FMA
# path decodes whole 32-bit words (8 weights) per thread and needs no per-weight registers beyond them: 32-128
# elements per thread and single-warp programs are in its range (the probe's best tile was 8 x 512 on one warp).
FMA_BLOCK_N, FMA_BLOCK_K = (4, 8, 16, 32), (256, 512, 1024)
DOT_BLOCK_N, DOT_BLOCK_K = (16, 32, 64, 128), (64, 128, 256, 512)
WARPS = (2, 4, 8)
FMA_WARPS = (1, 2, 4)
SPLITS = (1, 2, 4, 8, 16)
ELEMS_PER_THREAD = (16, 64)
FMA_ELEMS_PER_THREAD = (32, 128)
WARPS_PER_SM_TARGET = 24  # split_k aims at 24 / num_warps programs per SM (the heuristic: 6 at 4 warps) ...
SPLIT_WINDOW = 2.0  # ... and keeps split_k values within 2**2 of it
SPLITS_KEPT = {"fma": 2, "dot": 2, "dot-m1": 1, "fma-unfactored": 1, "fma-packed": 1}
TOP = 4  # pass 2 tries the TOP best tilings of M=16

TOLERANCE = 2.0**-5  # max |fused - reference| / max |reference|; bf16 roundings are ~2**-8, a wrong tiling O(1)
FINALIZE_RESERVE_S = 12.0  # the sweep stops this long before --time-budget: tables, JSON and plot still fit

SUMMARY_COLUMNS = [
    "kind", "shape", "N", "K", "M", "best", "best_us", "fwd_us", "default", "default_us", "default_fwd_us",
    "large_us", "bnb_us", "bnb_timing", "weight_MB", "GBps", "pct_copy", "speedup_vs_default", "speedup_vs_large",
    "speedup_vs_bnb", "crossover_m", "candidates", "wrong", "errors", "status", "note",
]  # fmt: skip
CANDIDATE_COLUMNS = ["kind", "shape", "M", "pass", "source", "config", *CONFIG_FIELDS, "us", "rel_err", "status",
                     "error"]  # fmt: skip


# ---- tilings and the grid (pure: tested on the CPU) ----------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A tiling is a ``SmallMConfig`` whose ``split_k`` is the effective one (what the launcher runs), so equal tilings
# compare equal and each compiles once.
Tiling = SmallMConfig


def tiling_label(t: SmallMConfig) -> str:
    stages = f" st{t.num_stages}" if t.num_stages != 1 else ""
    unfactored = " unfactored" if not t.factor_scales else ""
    packed = " packed" if t.packed_dot else ""
    rows = f" m{t.block_m}" if t.use_dot and t.block_m != 16 else ""
    path = "dot" if t.use_dot else "fma"
    return f"{path} n{t.block_n} k{t.block_k} s{t.split_k} w{t.num_warps}{stages}{unfactored}{packed}{rows}"


def make_tiling(k: int, use_dot: bool, block_n: int, block_k: int, split_k: int = 1, num_warps: int = 4,
                num_stages: int = 1, factor_scales: Optional[bool] = None,
                block_m: int = 16, packed_dot: bool = False) -> SmallMConfig:  # fmt: skip
    """A tiling with its effective ``split_k``; ``factor_scales=None`` keeps ``SmallMConfig``'s default."""
    split = effective_split_k(k, block_k, split_k)
    extra = {} if factor_scales is None else {"factor_scales": factor_scales}
    return SmallMConfig(bool(use_dot), block_n, block_k, split, num_warps, num_stages, **extra, block_m=block_m,
                        packed_dot=packed_dot)  # fmt: skip


def as_tiling(k: int, config: SmallMConfig) -> Tiling:
    """``config`` (the heuristic's or the table's) as a tiling: the same fields with its effective ``split_k``."""
    return make_tiling(k, **{field: getattr(config, field) for field in CONFIG_FIELDS})


def elems_per_thread(use_dot: bool) -> tuple[int, int]:
    """The (lowest, highest) weight elements per thread of a candidate tile."""
    return ELEMS_PER_THREAD if use_dot else FMA_ELEMS_PER_THREAD


def tile_grid(use_dot: bool, warps=WARPS) -> list[tuple[int, int, int]]:
    """(block_n, block_k, num_warps) with 16-64 weight elements per thread; for tensor cores also BLOCK_N >= 16 and
    at most BLOCK_N / 4 warps (more would only duplicate the (BLOCK_N, 16) MMA)."""
    block_ns, block_ks = (DOT_BLOCK_N, DOT_BLOCK_K) if use_dot else (FMA_BLOCK_N, FMA_BLOCK_K)
    low, high = elems_per_thread(use_dot)
    tiles = []
    for bn, bk, nw in itertools.product(block_ns, block_ks, warps):
        per_thread = bn * bk // (32 * nw)
        if low <= per_thread <= high and (not use_dot or nw <= bn // 4):
            tiles.append((bn, bk, nw))
    return tiles


def split_candidates(m: int, n: int, k: int, use_dot: bool, block_n: int, block_k: int, num_warps: int, sms: int,
                     keep: int) -> list[int]:  # fmt: skip
    """Effective split_k values whose program count is nearest ``WARPS_PER_SM_TARGET / num_warps`` per SM."""
    tiles = cdiv(n, block_n) * cdiv(m, 16 if use_dot else 1)
    target = sms * WARPS_PER_SM_TARGET / num_warps
    options = sorted({effective_split_k(k, block_k, s) for s in SPLITS if s <= cdiv(k, block_k)})

    def distance(s: int) -> float:
        return abs(math.log2(tiles * s / target))

    ranked = sorted(options, key=lambda s: (distance(s), s))
    near = [s for s in ranked if distance(s) <= SPLIT_WINDOW]
    return sorted((near or ranked[:1])[:keep])


def candidate_grid(m: int, n: int, k: int, sms: int, unfactored: bool = False, m1_stages=(1,)) -> list[Tiling]:
    """Pass-1 candidates for ``m`` rows: M=1: FMA tilings, the same with the packed bf16 path (``packed_dot``,
    which the launcher uses on bf16 rows only) and tensor-core tiles at 4 warps (and with ``unfactored``, FMA tiles at
    4 warps with ``factor_scales=False``); each M=1 FMA tiling also with every ``m1_stages`` above 1 (its tiles
    staged through shared memory by Triton's pipeliner instead of prefetched in registers); M>1: tensor-core
    tilings."""
    groups = [("fma", False, FMA_WARPS, None, False), ("fma-packed", False, (1,), None, True),
              ("dot-m1", True, (4,), None, False)] if m == 1 else [("dot", True, WARPS, None, False)]  # fmt: skip
    if m == 1 and unfactored:
        groups.append(("fma-unfactored", False, (4,), False, False))
    grid = []
    for name, use_dot, warps, factor_scales, packed in groups:
        for bn, bk, nw in tile_grid(use_dot, warps):
            if bk > max(16, 1 << (k - 1).bit_length()):  # a tile wider than K only adds masked lanes
                continue
            stages = m1_stages if m == 1 and not use_dot and factor_scales is None else (1,)
            for s, st in itertools.product(split_candidates(m, n, k, use_dot, bn, bk, nw, sms, SPLITS_KEPT[name]),
                                           stages):  # fmt: skip
                grid.append(make_tiling(k, use_dot, bn, bk, s, nw, st, factor_scales=factor_scales,
                                        packed_dot=packed))  # fmt: skip
    return list(dict.fromkeys(grid))


def finalists(ranked: list[Tiling], m: int, ref_m: int, k: int, top: int = TOP) -> list[Tiling]:
    """Pass-2 candidates for ``m`` rows from the tensor-core tilings of ``ref_m`` rows, fastest first: the ``top``
    best, and for the best two, split_k rescaled so that the program count stays as it was at ``ref_m`` (every
    16 rows add a row of programs). Past 16 rows, the ``top`` best also with programs of more rows (``block_m`` 32
    or 64, the fewest that hold ``m``), which decode each weight tile once for all of them."""
    best = [t for t in ranked if t.use_dot][:top]
    out = list(best)
    ratio = cdiv(m, 16) / cdiv(ref_m, 16)
    if ratio != 1:
        for t in best[:2]:
            split = max(1, round(t.split_k / ratio))
            out.append(make_tiling(k, t.use_dot, t.block_n, t.block_k, split, t.num_warps, t.num_stages,
                                   t.factor_scales, t.block_m))  # fmt: skip
    if m > 16:
        block_m = next((b for b in BLOCK_MS if b >= m), BLOCK_MS[-1])
        out.extend(dataclasses.replace(t, block_m=block_m) for t in best)
    return list(dict.fromkeys(out))


def crossover_m(ms, fused_us: dict, large_us: dict) -> int:
    """Largest M of ``ms`` at which the fused forward is faster than the large-M path at that M and at every smaller
    M of ``ms``; 0 if it is not faster at the smallest. An M that was not measured ends the scan."""
    crossover = 0
    for m in sorted(ms):
        fused, large = fused_us.get(m), large_us.get(m)
        if fused is None or large is None or not fused < large:  # NaN compares False: it ends the scan too
            break
        crossover = m
    return crossover


# ---- argument parsing ----------------------------------------------------------------------------------------------


def parse_shapes(value: str) -> list[tuple[int, int]]:
    shapes = []
    for item in C.parse_csv_arg(value) or []:
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected NxK items (out x in features) like '14336x4096', got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise argparse.ArgumentTypeError(f"no shapes in {value!r}")
    return list(dict.fromkeys(shapes))


def shapes_of_model(config: dict) -> list[tuple[int, int]]:
    """(N, K) of a decoder's linear layers from a transformers config dict: q, k / v, o, gate / up, down."""
    config = config.get("text_config") or config  # multimodal configs nest the language model's
    missing = [key for key in ("hidden_size", "intermediate_size", "num_attention_heads") if key not in config]
    if missing:
        raise ValueError(f"the config has no {missing} (a decoder-only transformers config has them)")
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (hidden, heads * head_dim), (inter, hidden),
              (hidden, inter)]  # fmt: skip
    return list(dict.fromkeys(shapes))


def parse_model_config(value: str) -> list[tuple[int, int]]:
    """``--model-config``: a transformers ``config.json`` (or the folder holding it) -> its linear shapes."""
    path = Path(value)
    path = path / "config.json" if path.is_dir() else path
    try:
        return shapes_of_model(json.loads(path.read_text()))
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"cannot read the linear shapes of {path}: {err}") from err


def parse_ms(value: str) -> list[int]:
    items = C.parse_csv_arg(value) or []
    if not items or not all(i.isdigit() and int(i) > 0 for i in items):
        raise argparse.ArgumentTypeError(f"expected positive integers like '1,2,4,16', got {value!r}")
    return sorted({int(i) for i in items})


def parse_kinds(value: str) -> list[str]:
    kinds = C.parse_csv_arg(value) or []
    bad = [kind for kind in kinds if kind not in KINDS]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"kinds must be a comma list of {list(KINDS)}, got {value!r}")
    return [kind for kind in KINDS if kind in kinds]


def default_workers() -> int:
    """Cores this process may use (a container may see more host cores than it gets), less 2, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(0, min(16, cores - 2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tune"), help="output directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="NxK list (default: Llama-3-8B's three)")
    which.add_argument("--model-config", type=parse_model_config, dest="model_shapes", metavar="PATH",
                       help="a model's transformers config.json (or its folder): tune the shapes of its linear layers "
                       "(q, k / v, o, gate / up, down) instead of --shapes")  # fmt: skip
    p.add_argument("--kinds", type=parse_kinds, default=list(KINDS), help="nf4,int8")
    p.add_argument("--ms", type=parse_ms, default=list(MS), help=f"row counts M (default {','.join(map(str, MS))})")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds for the whole run (default 240)")
    p.add_argument(
        "--compile-workers",
        type=int,
        default=default_workers(),
        help="processes compiling tilings ahead of each pass (0: compile on first use)",
    )
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing of a candidate")
    p.add_argument("--top", type=int, default=TOP, help="pass 2 tries this many of the best M=16 tilings")
    p.add_argument("--l2-mb", type=float, default=50.0, help="L2 size to defeat (H100/H200: 50 MB)")
    p.add_argument("--merge", type=Path, help="also merge the result into this JSON table (other entries kept)")
    p.add_argument("--from-json", type=Path, help="no measuring: merge this JSON table into --merge FILE")
    p.add_argument("--plan", action="store_true", help="print the candidate grid sizes and exit (no GPU)")
    p.add_argument(
        "--check-defaults",
        action="store_true",
        help="no search: time the heuristic's tiling (what an untabled shape runs) and the shipped table's against "
        "the large-M path and PEFT+bnb at every M; writes no JSON table",
    )
    p.add_argument("--m1-stages", type=lambda v: tuple(int(s) for s in v.split(",")), default=(1,),
                   help="num_stages of the M=1 FMA tilings, e.g. 1,3,4 (> 1: loads staged by Triton's pipeliner)")
    p.add_argument("--sms", type=int, default=132, help="SM count assumed by --plan (H100/H200 SXM: 132)")
    return p


# ---- the JSON table ------------------------------------------------------------------------------------------------


def shape_entry(by_m: dict[int, dict], ms) -> dict:
    """``{"crossover_m", "configs"}`` of one (kind, shape) from rows ``{M: {"tiling", "fwd_us", "large_us"}}``."""
    fused = {m: r.get("fwd_us") for m, r in by_m.items()}
    large = {m: r.get("large_us") for m, r in by_m.items()}
    configs = {str(m): by_m[m]["tiling"].to_json() for m in sorted(by_m) if by_m[m].get("tiling") is not None}
    return {"crossover_m": crossover_m(ms, fused, large), "configs": configs}


def device_table(device: str, torch_version: str, triton_version: str, date: str, kinds: dict) -> dict:
    """A table (``tuning.py``'s format) holding one device; ``kinds``: ``{kind: {"NxK": shape_entry}}``."""
    entry = {"torch": torch_version, "triton": triton_version, "date": date, "kinds": kinds}
    return {"format": TABLE_FORMAT, "devices": {device: entry}}


def write_table(path: Path, table: dict) -> None:
    _write_table(path, table)
    print(f"wrote {path}", flush=True)


def merge_into(path: Path, new: dict) -> dict:
    """Merges ``new`` into the table at ``path`` (created if missing), writes it back and returns it."""
    if Path(path).exists():
        merged = merge_tables(read_table(path), new)
    else:
        print(f"note: {path} does not exist; creating it", flush=True)
        merged = merge_tables(empty_table(), new)
    write_table(path, merged)
    return merged


# ---- outputs (tables, CSV, JSON, plot) from result rows: no GPU needed ---------------------------------------------


def add_crossovers(rows: list[dict], ms) -> dict[tuple[str, str], int]:
    """Crossover per (kind, shape) from the summary rows; also stored in each row."""
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        groups.setdefault((row["kind"], row["shape"]), {})[row["M"]] = row
    crossovers = {}
    for key, by_m in groups.items():
        crossovers[key] = crossover_m(ms, {m: r.get("fwd_us") for m, r in by_m.items()},
                                      {m: r.get("large_us") for m, r in by_m.items()})  # fmt: skip
        for row in by_m.values():
            row["crossover_m"] = crossovers[key]
    return crossovers


def results_table(rows: list[dict], ms, device: str, torch_version: str, triton_version: str, date: str) -> dict:
    kinds: dict[str, dict] = {}
    by_shape: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        if row.get("tiling") is not None:
            by_shape.setdefault((row["kind"], row["shape"]), {})[row["M"]] = row
    for (kind, shape), by_m in by_shape.items():
        kinds.setdefault(kind, {})[shape] = shape_entry(by_m, ms)
    return device_table(device, torch_version, triton_version, date, kinds)


def print_summary(rows: list[dict], crossovers: dict, copy_gbs: Optional[float], ms) -> None:
    cols = ["kind", "shape", "M", "best", "best_us", "fwd_us", "default_us", "large_us", "bnb_us", "GBps", "pct_copy",
            "speedup_vs_large", "speedup_vs_bnb", "status"]  # fmt: skip
    C.print_table(
        rows,
        cols,
        f"== fused small-M tuning (us per call, CUDA graph over L2-defeating copies); best_us / default_us: "
        f"re-timed sweep; fwd_us: the best timed again as a forward; d2d copy {C.fmt(copy_gbs, 4)} GB/s ==",
    )
    print("\n== crossover: fused path used for M <= crossover_m (largest grid M where it wins there and below) ==")
    for (kind, shape), value in crossovers.items():
        measured = sorted(r["M"] for r in rows if (r["kind"], r["shape"]) == (kind, shape) and r.get("fwd_us"))
        at_end = " (end of the grid: a lower bound)" if value and value == max(ms) else ""
        print(f"  {kind:5s} {shape:11s} crossover_m = {value}{at_end}   measured M: {measured}", flush=True)


def plot_results(rows: list[dict], crossovers: dict, ms, path: Path, env: dict) -> None:
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    if not kinds:
        return
    fig, axes = plt.subplots(len(kinds), len(shapes), figsize=(5.0 * len(shapes), 3.8 * len(kinds)), squeeze=False)
    series = [("fused, tuned", "fwd_us", "-o"), ("fused, default tiling", "default_fwd_us", ":o"),
              ("dequant + cuBLAS (large-M path)", "large_us", "-s"), ("PEFT + bnb", "bnb_us", "-^")]  # fmt: skip
    for (i, kind), (j, shape) in itertools.product(enumerate(kinds), enumerate(shapes)):
        ax = axes[i][j]
        sel = sorted((r for r in rows if r["kind"] == kind and r["shape"] == shape), key=lambda r: r["M"])
        for label, key, style in series:
            points = [(r["M"], r[key]) for r in sel if isinstance(r.get(key), (int, float)) and r[key] > 0]
            if points:
                ax.plot(*zip(*points), style, label=label, markersize=3)
        crossover = crossovers.get((kind, shape))
        if crossover:
            ax.axvline(crossover, color="k", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ms))
        ax.set_xticklabels([str(m) for m in ms], fontsize=7)
        ax.set_title(f"{kind} {shape} (N x K): crossover M = {crossover}", fontsize=9)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("us per call")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    C.save_figure(fig, path, env)


def csv_row(row: dict) -> dict:
    return {key: value for key, value in row.items() if key != "tiling"}


def print_default_crossovers(rows: list[dict], ms) -> None:
    """--check-defaults: the crossover the heuristic's tiling alone would give (what an untabled shape gets)."""
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        groups.setdefault((row["kind"], row["shape"]), {})[row["M"]] = row
    print("\n== the heuristic's tiling alone: fused path faster than the large-M path for M <= crossover ==")
    for (kind, shape), by_m in groups.items():
        value = crossover_m(ms, {m: r.get("default_fwd_us") for m, r in by_m.items()},
                            {m: r.get("large_us") for m, r in by_m.items()})  # fmt: skip
        speedups = {m: _ratio(r.get("large_us"), r.get("default_fwd_us")) for m, r in sorted(by_m.items())}
        ratios = " ".join(f"M={m}:{value:.2f}x" for m, value in speedups.items() if value is not None)
        print(f"  {kind:5s} {shape:11s} heuristic crossover_m = {value}   large-M / heuristic: {ratios}", flush=True)


def finalize(rows: list[dict], cand_rows: list[dict], ms, out: Path, env: dict, copy_gbs: Optional[float],
             device: str, versions: tuple[str, str], merge: Optional[Path], check: bool = False) -> None:  # fmt: skip
    """Crossovers, CSVs, printed tables, the JSON table (merged into ``merge`` if given; none with ``check``, where
    the tilings are the heuristic's and the table's, not a search's) and the plot."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    order = {kind: i for i, kind in enumerate(KINDS)}
    rows = sorted(rows, key=lambda r: (order.get(r["kind"], len(order)), r["N"], r["K"], r["M"]))
    crossovers: dict = {}

    def crossover_step():
        crossovers.update(add_crossovers(rows, ms))

    def json_step():
        table = results_table(rows, ms, device, versions[0], versions[1], date)
        write_table(out / JSON_NAME, merge_into(merge, table) if merge else table)

    C.run_finalize_steps([
        ("crossover", crossover_step),
        ("csv", lambda: (C.CsvLog(out / "tune_small_m.csv", SUMMARY_COLUMNS, env).rewrite([csv_row(r) for r in rows]),
                         C.CsvLog(out / "tune_candidates.csv", CANDIDATE_COLUMNS, env).rewrite(cand_rows))),
        ("tables", lambda: print_summary(rows, crossovers, copy_gbs, ms)),
        *([("heuristic", lambda: print_default_crossovers(rows, ms))] if check else [("json", json_step)]),
        ("plot", lambda: plot_results(rows, crossovers, ms, out / "tune_small_m.png", env)),
    ])  # fmt: skip


# ---- compiling ahead in worker processes ---------------------------------------------------------------------------

_WORKER_TENSORS: dict = {}  # worker process only: its dummy weights and LoRA factors, by (kind, n, k)


def _worker_ready(device: str) -> int:
    """First job of every worker: imports Triton and the kernel and creates the CUDA context."""
    import peft_fastlora.ops.kernels.small_m  # noqa: F401

    torch.zeros(1, device=device)
    return os.getpid()


def _worker_tensors(kind: str, n: int, k: int, device: str):
    key = (kind, n, k, device)
    if key not in _WORKER_TENSORS:
        import bitsandbytes.functional as bnbF

        from peft_fastlora.bnb import packed4bit_from_bnb
        from peft_fastlora.ops.quant_state import Int8Rowwise

        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        if kind == "int8":
            cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
            weight = Int8Rowwise(cb=cb, scb=scb)
        else:  # as bnb.nn.Linear4bit quantizes: nf4, blocksize 64, double quant, uint8 storage
            q, st = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True,
                                       quant_storage=torch.uint8)  # fmt: skip
            weight = packed4bit_from_bnb(q, st)
        _WORKER_TENSORS[key] = (weight, torch.randn(n, RANK, device=device, dtype=torch.bfloat16))
    return _WORKER_TENSORS[key]


def _compile_job(kind: str, tiling: dict, uses: list[tuple[int, int, int]], device: str) -> tuple[Optional[str], float]:
    """Launches ``tiling`` once per (n, k, m) use with the argument types, alignments and sizes of the real run, so
    that every specialization the main process will launch is compiled into Triton's on-disk cache."""
    from peft_fastlora.ops.kernels.small_m import small_m_linear_tiled

    start = time.monotonic()
    try:
        config = SmallMConfig.from_json(tiling)
        for n, k, m in uses:
            weight, lora_b = _worker_tensors(kind, n, k, device)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            lora_a = torch.randn(RANK, k, device=device, dtype=torch.bfloat16)
            small_m_linear_tiled(x, weight, None, x, lora_a, lora_b, SCALING, config)
        C.sync(torch.device(device))
    except Exception as err:  # reported; the main process still tries the tiling (and records its error)
        return C.short_error(err), time.monotonic() - start
    return None, time.monotonic() - start


class Precompiler:
    """A pool of spawned processes that compile the tilings of a pass before the main process times them."""

    def __init__(self, workers: int, device: torch.device):
        self.workers, self.device = workers, str(device)
        self.pool: Optional[ProcessPoolExecutor] = None
        self.failed: dict[tuple[str, Tiling], str] = {}  # reported only: the main process still tries these
        # (kind, tiling, (n, k, m)) launched by a worker: M=1, M%16 != 0 and M%16 == 0 are distinct specializations
        self.done: set[tuple[str, Tiling, tuple[int, int, int]]] = set()

    def start(self) -> None:
        if self.workers <= 0:
            return
        self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        for _ in range(self.workers):  # spawns every worker now: they import while the main process sets up
            self.pool.submit(_worker_ready, self.device)

    def run(self, jobs: dict[tuple[str, Tiling], list], label: str, time_left: Callable[[], float]) -> None:
        jobs = {(kind, t): [u for u in uses if (kind, t, u) not in self.done] for (kind, t), uses in jobs.items()}
        jobs = {key: uses for key, uses in jobs.items() if uses}
        if self.pool is None or not jobs:
            return
        start = time.monotonic()
        print(f"\n-- compiling {len(jobs)} tilings for {label} on {self.workers} processes", flush=True)
        futures = {self.pool.submit(_compile_job, kind, t.to_json(), uses, self.device): (kind, t)
                   for (kind, t), uses in jobs.items()}  # fmt: skip
        finished, busy_s, step = 0, 0.0, max(1, len(jobs) // 8)
        try:
            for future in as_completed(futures, timeout=max(1.0, time_left())):
                error, seconds = future.result()
                finished += 1
                busy_s += seconds
                kind, tiling = key = futures[future]
                self.done.update((kind, tiling, use) for use in jobs[key])
                if error:
                    self.failed[key] = error
                if finished % step == 0 or finished == len(jobs):
                    print(f"   {finished}/{len(jobs)} compiled, {len(self.failed)} failed, "
                          f"{time.monotonic() - start:.0f} s [t={elapsed():.0f} s]", flush=True)  # fmt: skip
        except FuturesTimeout:
            pending = [f for f in futures if not f.done()]
            for f in pending:
                f.cancel()
            print(f"!! time budget: {len(pending)} tilings left to compile on first use", flush=True)
        except Exception as err:  # a broken pool: the main process compiles what is left itself
            print(f"!! compile workers failed ({C.short_error(err)}); compiling in the main process", flush=True)
            self.close()
            return
        if finished:
            failed = sorted(tiling_label(t) for _, t in self.failed)[:6]
            print(f"   {label}: {time.monotonic() - start:.0f} s wall, {busy_s / finished:.1f} s per tiling "
                  f"(worker time); failed: {failed}", flush=True)  # fmt: skip

    def close(self) -> None:
        if self.pool is None:
            return
        processes = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # workers this script spawned; a hung compile must not outlive the run
            if process.is_alive():
                process.terminate()
        self.pool = None


def elapsed() -> float:
    return time.monotonic() - _T0


# ---- one (kind, shape): weights, LoRA factors, PEFT+bnb layers ----------------------------------------------------


class CudaBroken(RuntimeError):
    """The CUDA context no longer works: nothing more can be measured."""


class Case:
    """``copies`` independent bnb layers of one kind and shape with PEFT LoRA adapters (bf16, r=16, B random), and
    the same weights as ``peft_fastlora`` containers: every provider reads the same bytes."""

    def __init__(self, kind: str, n: int, k: int, device: torch.device, l2_mb: float):
        from peft import LoraConfig, get_peft_model

        from peft_fastlora.bnb import int8_from_bnb, packed4bit_from_bnb

        self.kind, self.n, self.k, self.shape = kind, n, k, shape_key(n, k)
        quant = "nf4-dq" if kind == "nf4" else "int8"

        def base_layer():
            weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            # int8: outlier threshold 0 (no host sync), so that bnb's forward can be captured in a CUDA graph.
            layer = C.make_base_layer(weight, quant, device, 0.0)
            w = layer.weight  # containers are built before any forward (bnb int8 moves CB/SCB on forward)
            return layer, int8_from_bnb(w) if kind == "int8" else packed4bit_from_bnb(w.data, w.quant_state)

        first = base_layer()
        self.weight_bytes = C.weight_bytes(first[1])
        self.copies = C.copies_for(self.weight_bytes, l2_mb)
        built = [first] + [base_layer() for _ in range(self.copies - 1)]
        self.weights = [w for _, w in built]
        config = LoraConfig(r=RANK, lora_alpha=int(SCALING * RANK), target_modules=r"layers\.\d+", lora_dropout=0.0,
                            init_lora_weights=False)  # fmt: skip
        model = get_peft_model(_Stack([layer for layer, _ in built]), config, autocast_adapter_dtype=False)
        for param in model.parameters():
            if param.requires_grad:  # bf16 adapters everywhere: the comparison is of kernels, not adapter dtypes
                param.data = param.data.to(torch.bfloat16)
        model.eval()
        self.layers = list(model.base_model.model.layers)
        self.lora_a = [layer.lora_A["default"].weight.detach() for layer in self.layers]
        self.lora_b = [layer.lora_B["default"].weight.detach().contiguous() for layer in self.layers]
        self.scaling = float(self.layers[0].scaling["default"])
        self.model = model
        self.rows: dict[int, dict] = {}  # M -> summary row
        self.ranked: dict[int, list[Tiling]] = {}  # M -> verified tilings, fastest first


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16


# ---- the tuner -----------------------------------------------------------------------------------------------------


class Tuner:
    def __init__(self, args, device: torch.device, timer: Callable = C.graph_time_us):
        self.args, self.device, self.timer = args, device, timer
        self.ms = list(args.ms)
        self.deadline = args.time_budget - FINALIZE_RESERVE_S
        self.rows: list[dict] = []
        self.cand_rows: list[dict] = []
        self.cases: list[Case] = []
        self.precompiler = Precompiler(args.compile_workers, device)
        self.sms = 132
        self.copy_gbs: Optional[float] = None
        self.stopped: Optional[str] = None  # why the sweep ended early

    # -- budget --
    def time_left(self) -> float:
        return self.deadline - elapsed()

    def out_of_time(self) -> bool:
        if self.stopped is None and self.time_left() <= 0:
            self.stopped = f"time budget: sweep stopped at {elapsed():.0f} s (--time-budget {self.args.time_budget:g})"
            print(f"!! {self.stopped}", flush=True)
        return self.stopped is not None

    def check_health(self) -> None:
        if not C.cuda_healthy(self.device):
            self.stopped = "CUDA context broken by a failed launch"
            raise CudaBroken(self.stopped)

    # -- which Ms, which tilings --
    def pass1_ms(self) -> list[int]:
        first = [m for m in PASS1_MS if m in self.ms]
        return first or self.ms[:1]

    def ref_m(self) -> Optional[int]:
        """The M whose tensor-core sweep seeds pass 2 (16, else the smallest pass-1 M above 1)."""
        return next((m for m in self.pass1_ms() if m > 1), None)

    def default_tiling(self, case: Case, m: int) -> Tiling:
        """The heuristic's tiling (what an untabled shape runs), with its effective split."""
        from peft_fastlora.ops.kernels.small_m import heuristic_config

        config = heuristic_config(m, case.n, case.k, self.device, case.kind)
        return as_tiling(case.k, config)

    def check_candidates(self, case: Case, m: int) -> list[tuple[Tiling, str]]:
        """--check-defaults: the heuristic's tiling and the shipped table's (where it lists this GPU and shape)."""
        from peft_fastlora.ops.kernels.tuning import tuned_config

        tabled = tuned_config(self.device, case.kind, m, case.n, case.k)
        table = [] if tabled is None else [(as_tiling(case.k, tabled), "table")]
        return [(self.default_tiling(case, m), "default")] + table

    def pass1_candidates(self, case: Case, m: int) -> list[tuple[Tiling, str]]:
        if self.args.check_defaults:
            return self.check_candidates(case, m)
        grid = candidate_grid(m, case.n, case.k, self.sms, unfactored=case.kind == "nf4",
                              m1_stages=self.args.m1_stages)  # fmt: skip
        return [(self.default_tiling(case, m), "default")] + [(t, "grid") for t in grid]

    def pass2_candidates(self, case: Case, m: int) -> list[tuple[Tiling, str]]:
        if self.args.check_defaults:
            return self.check_candidates(case, m)
        ref = self.ref_m()
        ranked = case.ranked.get(ref, []) if ref else []
        picks = finalists(ranked, m, ref, case.k, self.args.top) if ref else []
        return [(self.default_tiling(case, m), "default")] + [(t, f"M={ref} best") for t in picks]

    def compile_jobs(self, plan: list[tuple[Case, int, list[tuple[Tiling, str]]]]) -> dict:
        jobs: dict[tuple[str, Tiling], list] = {}
        for case, m, candidates in plan:
            for tiling, _ in candidates:
                uses = jobs.setdefault((case.kind, tiling), [])
                if (case.n, case.k, m) not in uses:
                    uses.append((case.n, case.k, m))
        return jobs

    # -- measuring one (kind, shape, M) --
    def forward_calls(self, case: Case, x: torch.Tensor, tiling: Tiling) -> list[Callable]:
        """The fused forward with an explicit tiling: one launch (plus the memset of its counters), the LoRA
        down-projection included."""
        from peft_fastlora.ops.kernels.small_m import small_m_linear_tiled

        s = case.scaling
        return [lambda w=w, a=a, b=b: small_m_linear_tiled(x, w, None, x, a, b, s, tiling)
                for w, a, b in zip(case.weights, case.lora_a, case.lora_b)]  # fmt: skip

    def provider_us(self, calls: list[Callable], reps: int) -> tuple[Optional[float], str]:
        """CUDA-graph time, or an eager time (CUDA events over the same calls) if capture fails."""
        try:
            return self.timer(calls, reps), "graph"
        except CudaBroken:
            raise
        except Exception as err:
            self.check_health()
            note = f"eager (graph capture failed: {C.short_error(err, 80)})"
        try:
            for call in calls:
                call()
            C.sync(self.device)
            start = time.perf_counter()
            for _ in range(reps):
                for call in calls:
                    call()
            C.sync(self.device)
            return (time.perf_counter() - start) * 1e6 / reps / len(calls), note
        except Exception as err:
            self.check_health()
            return None, "error: " + C.short_error(err)

    def measure(self, case: Case, m: int, candidates: list[tuple[Tiling, str]], phase: str) -> None:
        """Measures one (kind, shape, M); an unexpected failure becomes an error row and the sweep goes on."""
        try:
            self._measure(case, m, candidates, phase)
        except (KeyboardInterrupt, CudaBroken):
            raise
        except Exception as err:
            traceback.print_exc()
            self.check_health()
            self.record(case, m, dict(kind=case.kind, shape=case.shape, N=case.n, K=case.k, M=m, candidates=0,
                                      wrong=0, errors=1, status="error", note=C.short_error(err)))  # fmt: skip

    @torch.no_grad()
    def _measure(self, case: Case, m: int, candidates: list[tuple[Tiling, str]], phase: str) -> None:
        from peft_fastlora.ops.kernels.small_m import small_m_linear_tiled
        from peft_fastlora.ops.lora_linear import lora_linear_forward
        from peft_fastlora.ops.reference import lora_linear_ref

        reps, s = self.args.reps, case.scaling
        x = torch.randn(m, case.k, device=self.device, dtype=torch.bfloat16)
        ref = lora_linear_ref(x, case.weights[0], None, case.lora_a[0], case.lora_b[0], s).float()
        ref_max = ref.abs().max().item()
        default = candidates[0][0]
        timed: dict[Tiling, float] = {}
        counts = {"wrong": 0, "error": 0}
        seen: set[Tiling] = set()
        for tiling, source in candidates:
            if tiling in seen:
                continue
            seen.add(tiling)
            if self.out_of_time():
                break
            row = dict(kind=case.kind, shape=case.shape, M=m, source=source, config=tiling_label(tiling),
                       **tiling.to_json())
            row["pass"] = phase
            try:
                y = small_m_linear_tiled(x, case.weights[0], None, x, case.lora_a[0], case.lora_b[0], s, tiling)
                rel = ((y.float() - ref).abs().max() / ref_max).item()
                if not math.isfinite(rel) or rel > TOLERANCE:
                    row.update(status="wrong", rel_err=rel, error=f"max error {rel:.3g} x max |reference|")
                else:
                    timed[tiling] = self.timer(self.forward_calls(case, x, tiling), reps)
                    row.update(status="ok", rel_err=rel, us=timed[tiling])
            except Exception as err:
                row.update(status="error", error=C.short_error(err))
                self.check_health()
            if row["status"] != "ok":
                counts[row["status"]] += 1
                label = tiling_label(tiling)
                print(f"   {case.kind} {case.shape} M={m} {label}: {row['status']}: {row['error']}", flush=True)
            self.cand_rows.append(row)
        summary = dict(kind=case.kind, shape=case.shape, N=case.n, K=case.k, M=m, candidates=len(seen),
                       wrong=counts["wrong"], errors=counts["error"], weight_MB=case.weight_bytes / 1e6)  # fmt: skip
        if not timed:
            summary.update(status="no verified tiling" if seen else "skipped")
            self.record(case, m, summary)
            return
        # Re-time the fastest three (and the default) twice, interleaved, and keep each one's best.
        top = sorted(timed, key=timed.get)[:3] + ([default] if default in timed else [])
        top = list(dict.fromkeys(top))
        retimed = {t: math.inf for t in top}
        for _ in range(2):
            for t in top:
                retimed[t] = min(retimed[t], self.timer(self.forward_calls(case, x, t), 3 * reps))
        best = min(retimed, key=retimed.get)
        case.ranked[m] = sorted(timed, key=lambda t: retimed.get(t, timed[t]))
        fwd_us = self.timer(self.forward_calls(case, x, best), 2 * reps)
        default_fwd = None
        if default in timed:
            default_fwd = fwd_us if default == best else self.timer(self.forward_calls(case, x, default), 2 * reps)
        large = [lambda w=w, a=a, b=b: lora_linear_forward(x, None, a, b, s, None, w)
                 for w, a, b in zip(case.weights, case.lora_a, case.lora_b)]  # fmt: skip
        large_us, large_note = self.provider_us(large, 2 * reps)
        bnb_us, bnb_note = self.provider_us([lambda layer=layer: layer(x) for layer in case.layers], 2 * reps)
        gbps = case.weight_bytes / retimed[best] / 1e3
        summary.update(
            tiling=best, best=tiling_label(best), best_us=retimed[best], fwd_us=fwd_us, default=tiling_label(default),
            default_us=retimed.get(default), default_fwd_us=default_fwd, large_us=large_us, bnb_us=bnb_us,
            bnb_timing=bnb_note, GBps=gbps, pct_copy=100 * gbps / self.copy_gbs if self.copy_gbs else None,
            speedup_vs_default=_ratio(default_fwd, fwd_us), speedup_vs_large=_ratio(large_us, fwd_us),
            speedup_vs_bnb=_ratio(bnb_us, fwd_us), status="partial" if self.stopped else "ok",
            note="" if large_note == "graph" else f"large-M: {large_note}",
        )  # fmt: skip
        self.record(case, m, summary)

    def record(self, case: Case, m: int, row: dict) -> None:
        case.rows[m] = row
        self.rows.append(row)
        total = len(self.args.kinds) * len(self.args.shapes) * len(self.ms)
        parts = [f"[{len(self.rows):3d}/{total} t={elapsed():4.0f} s] {case.kind:4s} {case.shape:11s} M={m:<3d}"]
        if row.get("tiling") is not None:
            parts.append(
                f"best {row['best']:22s} {row['best_us']:7.1f} us (default {C.fmt(row.get('default_us'))})"
                f" | fwd {row['fwd_us']:7.1f} large-M {C.fmt(row.get('large_us'))} PEFT+bnb "
                f"{C.fmt(row.get('bnb_us'))} us | {row['GBps']:5.0f} GB/s {C.fmt(row.get('pct_copy'))}%"
            )
        parts.append(f"{row['candidates']} tilings, {row['wrong']} wrong, {row['errors']} errors")
        if row.get("status") != "ok":
            parts.append(f"[{row.get('status')}]")
        print(" | ".join(parts), flush=True)

    # -- passes --
    def lost(self, case: Case) -> Optional[int]:
        """Smallest measured M at which the fused forward was not faster than the large-M path."""
        losses = [m for m, r in case.rows.items() if r.get("fwd_us") and r.get("large_us") and
                  not r["fwd_us"] < r["large_us"]]  # fmt: skip
        return min(losses) if losses else None

    def sweep(self) -> None:
        a = self.args
        self.precompiler.start()
        import bitsandbytes  # noqa: F401  (everything imported before gc.freeze in setup_run)
        import peft  # noqa: F401
        import triton  # noqa: F401

        import peft_fastlora.ops.kernels.small_m  # noqa: F401

        C.setup_run()
        torch.manual_seed(0)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        print(f"\n-- building weights (nf4 double quant / int8, copies beyond {a.l2_mb:g} MB L2) and PEFT layers",
              flush=True)  # fmt: skip
        for kind, (n, k) in itertools.product(a.kinds, a.shapes):
            try:
                c = Case(kind, n, k, self.device, a.l2_mb)
            except Exception as err:  # e.g. a bnb layer that cannot be built: the other cases still run
                traceback.print_exc()
                self.check_health()
                print(f"!! {kind} {shape_key(n, k)} skipped: {C.short_error(err)}", flush=True)
                continue
            self.cases.append(c)
            print(f"   {kind} {c.shape}: {c.weight_bytes / 1e6:.1f} MB x {c.copies} copies [t={elapsed():.0f} s]",
                  flush=True)  # fmt: skip

        plan1 = [(c, m, self.pass1_candidates(c, m)) for c in self.cases for m in self.pass1_ms()]
        self.precompiler.run(self.compile_jobs(plan1), "pass 1", self.time_left)
        self.copy_gbs = C.copy_bandwidth_gbps()
        print(f"\n-- pass 1 (M in {self.pass1_ms()}): full grids; d2d copy {self.copy_gbs:.0f} GB/s", flush=True)
        for case, m, candidates in plan1:
            if self.out_of_time():
                return
            self.measure(case, m, candidates, "1")

        rest = [m for m in self.ms if m not in self.pass1_ms()]
        plan2 = [(c, m, self.pass2_candidates(c, m)) for m in rest for c in self.cases]
        self.precompiler.run(self.compile_jobs(plan2), "passes 2-3", self.time_left)
        self.precompiler.close()
        candidates = {(id(c), m): cands for c, m, cands in plan2}
        if rest:
            print(f"\n-- pass 2 (M in {rest}, ascending, until the fused path loses)", flush=True)
        later = []
        for case, m, _ in plan2:
            lost = self.lost(case)
            if lost is not None and m > lost:
                later.append((case, m))
                continue
            if self.out_of_time():
                return
            self.measure(case, m, candidates[(id(case), m)], "2")
        if later:
            print("\n-- pass 3 (M past the crossover, for the plot)", flush=True)
        for case, m in later:
            if self.out_of_time():
                return
            self.measure(case, m, candidates[(id(case), m)], "3")

    def run(self) -> int:
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        interrupted = False
        env = C.env_info(self.device)
        try:
            env["run"] = (f"tune_small_m kinds={self.args.kinds} shapes={[shape_key(*s) for s in self.args.shapes]} "
                          f"M={self.ms} r={RANK} bf16 budget={self.args.time_budget:g}s "
                          f"workers={self.args.compile_workers}")  # fmt: skip
            C.print_header("tune_small_m: fused small-M tilings and the small-M / large-M crossover", env)
            self.sweep()
        except KeyboardInterrupt:
            interrupted = True
            print("\n!! interrupted: writing what was measured", flush=True)
        except CudaBroken as err:
            print(f"\n!! {err}: writing what was measured", flush=True)
        except Exception:  # a bug must not cost the measurements made so far
            traceback.print_exc()
            print("\n!! the sweep failed: writing what was measured", flush=True)
        finally:
            self.precompiler.close()
        env["copy_GBps"] = C.fmt(self.copy_gbs, 5)
        import triton

        device_name = torch.cuda.get_device_name(self.device)
        finalize(self.rows, self.cand_rows, self.ms, out, env, self.copy_gbs, device_name,
                 (torch.__version__, triton.__version__), self.args.merge, self.args.check_defaults)  # fmt: skip
        measured = sum(1 for r in self.rows if r.get("tiling") is not None)
        total = len(self.args.kinds) * len(self.args.shapes) * len(self.ms)
        if measured < total:
            print(f"note: {measured}/{total} (kind, shape, M) measured; the JSON covers only those", flush=True)
        print(f"\ntune_small_m {'interrupted' if interrupted else 'done'} in {elapsed():.0f} s "
              f"(budget {self.args.time_budget:g} s); results in {out}", flush=True)  # fmt: skip
        return 130 if interrupted else 0


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None or den == 0 else num / den


# ---- entry points --------------------------------------------------------------------------------------------------


def print_plan(args) -> None:
    """Pass-1 candidate counts per (kind, shape, M) and the distinct tilings (compiles) per kind."""
    print(f"pass-1 grid with {args.sms} SMs (the default tiling not counted):")
    total = 0
    for kind in args.kinds:
        distinct: set[Tiling] = set()
        for (n, k), m in itertools.product(args.shapes, [m for m in PASS1_MS if m in args.ms]):
            grid = candidate_grid(m, n, k, args.sms, unfactored=kind == "nf4", m1_stages=args.m1_stages)
            distinct.update(grid)
            print(f"  {kind:4s} {shape_key(n, k):11s} M={m:<3d} {len(grid):3d} tilings "
                  f"({sum(not t.use_dot for t in grid)} FMA, {sum(t.use_dot for t in grid)} tensor-core)")  # fmt: skip
        print(f"  {kind}: {len(distinct)} distinct tilings over these shapes")
        total += len(distinct)
    print(f"pass 1 compiles {total} tilings in all (pass 2 adds the rescaled M=16 finalists)")


def merge_only(args) -> int:
    if args.merge is None:
        raise SystemExit("--from-json FILE needs --merge TARGET (the table to merge FILE into).")
    try:
        merged = merge_into(args.merge, read_table(args.from_json))
    except ValueError as err:
        raise SystemExit(str(err)) from err
    print(f"devices in {args.merge}: {sorted(merged['devices'])}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_shapes is not None:
        args.shapes = args.model_shapes
    if args.from_json is not None:
        return merge_only(args)
    if args.plan:
        print_plan(args)
        return 0
    if args.check_defaults and args.merge is not None:
        raise SystemExit("--check-defaults writes no table: drop --merge (or run without --check-defaults to tune).")
    if not torch.cuda.is_available():
        raise SystemExit(
            "tune_small_m.py times CUDA kernels, but torch.cuda.is_available() is False: run it on a GPU machine. "
            "(Merging tables needs no GPU: --from-json FILE --merge TARGET; --plan prints the grid.)"
        )
    if args.merge is not None and args.merge.exists():
        try:
            read_table(args.merge)  # fail now, not after the sweep
        except ValueError as err:
            raise SystemExit(f"--merge: {err}") from err
    device = torch.device("cuda", torch.cuda.current_device())
    return Tuner(args, device).run()


if __name__ == "__main__":
    sys.exit(main())
