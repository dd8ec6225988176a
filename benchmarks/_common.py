"""Helpers shared by the benchmark scripts: environment capture, CSV/table/plot output, timers, targets.

Every output file starts with the same header (GPU, library versions, date, command line) so that numbers from
different machines are never mixed up; every comparison is between providers measured in the same run.
"""

from __future__ import annotations

import csv
import datetime
import gc
import hashlib
import importlib.metadata
import logging
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/ first on the path, not the repo root
    sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # headless: the GPU box has no display
import torch  # noqa: E402

# ---- environment ---------------------------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        mod = __import__(module)
    except Exception as err:  # a broken install must not stop the benchmark
        return f"unavailable ({type(err).__name__})"
    return str(getattr(mod, "__version__", "?"))


def _git_revision() -> str:
    """Short HEAD, with ``+modified`` when the package or benchmark sources differ from it (a copied working tree can
    carry an older ``.git``: the device machines reported the session's first commit for later code)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "peft_fastlora", "benchmarks"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()  # fmt: skip
    except Exception:
        return "unknown"
    return (head + ("+modified" if dirty else "")) if head else "no commit"


def source_digest() -> str:
    """sha256 (12 hex digits) of the package's source files: identifies the code that ran, whatever git says.

    To match a CSV to a commit, check the commit out and run
    ``python -c "import sys; sys.path[:0] = ['benchmarks']; import _common; print(_common.source_digest())"``.
    """
    digest = hashlib.sha256()
    package = REPO_ROOT / "peft_fastlora"
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.json")]):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def env_info(device: torch.device) -> dict[str, str]:
    """GPU name, library versions, date and command line, for the header of every output."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    else:
        gpu = f"none (CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "gpu": gpu,
        "device": str(device),
        "torch": f"{torch.__version__} (cuda {torch.version.cuda})",
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "bitsandbytes": _version("bitsandbytes"),
        "peft_fastlora": f"{_version('peft_fastlora')} (git {_git_revision()}, source {source_digest()})",
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }


def header_lines(env: dict[str, str]) -> list[str]:
    return [f"{key}: {value}" for key, value in env.items()]


def print_header(title: str, env: dict[str, str]) -> None:
    print("=" * 100)
    print(title)
    for line in header_lines(env):
        print("  " + line)
    print("=" * 100, flush=True)


def setup_run() -> None:
    """Process-wide setup of a benchmark run; call it once everything is imported."""
    # Later gc.collect() calls (one per measured layer) then skip the ~10^6 objects that the imports created.
    gc.collect()
    gc.freeze()
    # bnb logs "MatMul8bitLt: inputs will be cast ... to float16" on every bf16 int8 call: thousands of lines.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' method renames, once per call site
    # `timeout` (run_gpu.sh) sends SIGTERM: turn it into KeyboardInterrupt so the scripts write tables, targets and
    # plots of what was measured before exiting. SIGINT too, even if the launching shell left it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch.cuda.is_available() is False; use --device cpu --tiny.")
    if name == "cpu":
        torch.set_num_threads(1)  # tiny CPU runs: one thread is fastest and steadiest on a shared CI box
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


# ---- CSV -----------------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


class CsvLog:
    """A CSV written row by row (flushed each time, so a killed run keeps what it measured).

    The file starts with ``# key: value`` lines (see [`env_info`]); read it back with [`read_csv`] or
    ``pandas.read_csv(path, comment="#")``.
    """

    def __init__(self, path: Path, columns: list[str], env: dict[str, str]):
        self.path, self.columns, self.env = Path(path), list(columns), env
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write([])

    def _write(self, rows: list[dict]) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "w", newline="") as f:
            for line in header_lines(self.env):
                f.write(f"# {line}\n")
            writer = csv.writer(f)
            writer.writerow(self.columns)
            for row in rows:
                writer.writerow([_cell(row.get(c)) for c in self.columns])
        os.replace(tmp, self.path)

    def append(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_cell(row.get(c)) for c in self.columns])

    def rewrite(self, rows: list[dict]) -> None:
        """Replaces the body with ``rows`` (used at the end, once every ratio can be computed)."""
        self._write(rows)


def _parse(value: str):
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def read_csv_header(path: Path) -> dict[str, str]:
    """The ``# key: value`` header of a [`CsvLog`] file as a dict."""
    env = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, _, value = line[1:].strip().partition(": ")
            env[key] = value
    return env


def read_csv(path: Path) -> list[dict]:
    """Rows of a [`CsvLog`] file, numbers parsed, empty cells as None."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("#")]
    return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(lines)]


# ---- tables --------------------------------------------------------------------------------------------------------


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 10**5 or abs(value) < 10 ** -(digits - 1)):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(rows: list[dict], columns: list[str], title: Optional[str] = None) -> str:
    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [] if title is None else ["", title]
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def print_table(rows: list[dict], columns: list[str], title: Optional[str] = None) -> None:
    print(format_table(rows, columns, title), flush=True)


# ---- timing --------------------------------------------------------------------------------------------------------


def _do_bench_median(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    import inspect

    import triton.testing

    if "return_mode" in inspect.signature(triton.testing.do_bench).parameters:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])  # older triton


def bench_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 20, rep_ms: float = 60,
             cpu_reps: int = 3) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` (L2 flushed per call) on CUDA, a timer on CPU."""
    if device.type == "cuda":
        return _do_bench_median(fn, warmup_ms, rep_ms)
    fn()
    times = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_graph_ms(fn: Callable[[], object], warmup_ms: float = 20, rep_ms: float = 60) -> float:
    """Captures ``fn`` in a CUDA graph and returns the median ms of one replay (launch overhead removed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires (also runs autotuning)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return _do_bench_median(graph.replay, warmup_ms, rep_ms)
    finally:
        del graph


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 2**30, warmup_ms: float = 20, rep_ms: float = 60) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read + written (the run's "HBM bandwidth")."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Frees what the last measurement left (bnb's Params4bit <-> Linear4bit references form cycles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def short_error(err: BaseException, limit: int = 160) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ").replace(",", ";")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cuda_healthy(device: torch.device) -> bool:
    """Whether the CUDA context still works (a failed graph capture can, rarely, leave it broken)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        (torch.ones(4, device=device) + 1).sum().item()
    except Exception:
        return False
    return True


class Deadline:
    """Soft time budget: work that would start after it is recorded as skipped instead of being killed mid-way."""

    def __init__(self, budget_s: Optional[float]):
        self.start = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return self.budget_s is not None and self.elapsed() > self.budget_s


# ---- targets -------------------------------------------------------------------------------------------------------

TARGET_COLUMNS = ["target", "case", "value", "op", "threshold", "result", "note"]


@dataclass
class Check:
    """One PASS/MISS line: ``value op threshold``; a missing value gives N/A."""

    target: str
    case: str
    value: Optional[float]
    op: str  # "<=" or ">="
    threshold: float
    note: str = ""

    @property
    def result(self) -> str:
        if self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            return "N/A"
        ok = self.value <= self.threshold if self.op == "<=" else self.value >= self.threshold
        return "PASS" if ok else "MISS"

    def row(self) -> dict:
        return {"target": self.target, "case": self.case, "value": self.value, "op": self.op,
                "threshold": self.threshold, "result": self.result, "note": self.note}  # fmt: skip


def write_targets(checks: list[Check], path: Path, env: dict[str, str], title: str) -> None:
    rows = [c.row() for c in checks]
    CsvLog(path, TARGET_COLUMNS, env).rewrite(rows)
    print_table(rows, TARGET_COLUMNS, title)
    counts = {r: sum(c.result == r for c in checks) for r in ("PASS", "MISS", "N/A")}
    print(f"targets: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['N/A']} N/A", flush=True)


# ---- plots ---------------------------------------------------------------------------------------------------------


def grouped_bars(ax, groups: list[str], series: dict[str, list[Optional[float]]], ylabel: str, title: str,
                 hlines: Iterable[tuple[float, str]] = (), colors: Optional[dict[str, str]] = None) -> None:
    """Bars of ``series[name][i]`` for each group ``groups[i]``; missing values leave a gap.

    ``colors`` maps a series name to a color, so a provider keeps its color in every panel.
    """
    import numpy as np

    names = list(series)
    width = 0.8 / max(len(names), 1)
    x = np.arange(len(groups))
    for j, name in enumerate(names):
        values = [float("nan") if v is None else float(v) for v in series[name]]
        color = None if colors is None else colors.get(name)
        ax.bar(x + (j - (len(names) - 1) / 2) * width, values, width, label=name, color=color)
    for y, label in hlines:
        ax.axhline(y, color="k", linestyle="--", linewidth=0.8)
        ax.annotate(label, (x[-1] + 0.45 if len(x) else 0, y), fontsize=7, ha="right", va="bottom")
    ax.set_xticks(x)
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def save_figure(fig, path: Path, env: dict[str, str]) -> None:
    fig.text(0.01, 0.005, f"{env.get('gpu', '')} | torch {env.get('torch', '')} | {env.get('date', '')}", fontsize=6)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}", flush=True)


def parse_csv_arg(value: Optional[str]) -> Optional[list[str]]:
    """``"a,b"`` -> ``["a", "b"]``; None stays None (meaning: the default)."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def run_finalize_steps(steps) -> None:
    """Runs ``(name, fn)`` steps (tables, targets, plots) in order; a failing step is reported and the rest still run,
    so one broken plot never costs the measured CSVs."""
    import traceback

    for name, step in steps:
        try:
            step()
        except Exception:
            print(f"!! finalize step {name!r} failed:", flush=True)
            traceback.print_exc()
