"""Helpers shared by the benchmark scripts: environment, the package internals they use, CSV/table output, row
lookups, timers, weight and layer builders, targets and plots.

Every output file starts with the same header (GPU, library versions, date, command line) so that numbers from
different machines are never mixed up; every comparison is between providers measured in the same run.
"""

from __future__ import annotations

import bisect
import csv
import datetime
import functools
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
from types import SimpleNamespace
from typing import Optional

import matplotlib
import torch
from torch import nn

matplotlib.use("Agg")  # headless: a GPU server has no display

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


def package_dir() -> Path:
    """Directory of the ``peft_fastlora`` that runs (the installed one, or this checkout's via ``PYTHONPATH``)."""
    import peft_fastlora

    return Path(peft_fastlora.__file__).resolve().parent


def _git_revision() -> str:
    """Short HEAD of the package's checkout, with ``+modified`` when the package or benchmark sources differ from it
    (a copied working tree can carry an older ``.git``)."""
    root = package_dir().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "peft_fastlora", "benchmarks"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()  # fmt: skip
    except Exception:
        return "unknown"
    return (head + ("+modified" if dirty else "")) if head else "no commit"


def source_digest() -> str:
    """sha256 (12 hex digits) of the package's source files: identifies the code that ran, whatever git says.

    To match a CSV to a commit, check the commit out and run, from the repository root,
    ``PYTHONPATH=.:benchmarks python -c "import _common; print(_common.source_digest())"``.
    """
    digest = hashlib.sha256()
    package = package_dir()
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.json")]):
        digest.update(path.relative_to(package.parent).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
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
    # SIGTERM (e.g. from `timeout`) and SIGINT become KeyboardInterrupt, so the scripts write tables, targets and plots
    # of what was measured before exiting. SIGINT too, even if the launching shell left it ignored.
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


# ---- package internals ---------------------------------------------------------------------------------------------


@functools.cache
def internals() -> SimpleNamespace:
    """Every non-public ``peft_fastlora`` name the benchmark scripts use, imported here and nowhere else.

    The public API (``FastLoraConfig``, ``peft_fastlora.ops.fastlora_linear``/``dequantize``/``Packed4bit``/
    ``Int8Rowwise``) is imported where it is used; what is below can move when the package is reorganized, and this is
    the one place to follow it.

    Attributes:
        packed4bit_from_bnb: ``(data, quant_state) -> Packed4bit`` from a bitsandbytes 4-bit weight.
        int8_from_bnb: ``(Int8Params) -> Int8Rowwise`` from a bitsandbytes int8 weight.
        fused_small_m: the fused small-M forward, ``(x, weight, bias, lora_a, lora_b, scaling) -> y``, called directly
            (no dispatch, no crossover lookup).
        pick_small_m_config: ``(m, n, k, device, kind) -> SmallMConfig``, the tiling the dispatcher would launch.
        launch_cache_size: ``() -> int``, compiled kernels in the launch cache.
        launch_hooks_set: ``() -> bool``, whether Triton launch hooks are set (they slow every launch).
        lowrank_add: ``(out, a, b, scaling) -> out``, the Triton ``out += scaling * a @ b.T`` in place.
        swiglu: the SwiGLU kernels' module (``silu_mul``, ``silu_mul_backward``, ``silu_mul_backward_lora``).
    """
    from peft_fastlora.bnb import int8_from_bnb, packed4bit_from_bnb
    from peft_fastlora.ops.kernels import launch, load, small_m

    return SimpleNamespace(
        packed4bit_from_bnb=packed4bit_from_bnb,
        int8_from_bnb=int8_from_bnb,
        fused_small_m=lambda x, w, bias, a, b, s: small_m.small_m_linear(x, w, bias, a, b, s, x),
        pick_small_m_config=small_m.pick_config,
        launch_cache_size=lambda: len(launch._compiled),
        launch_hooks_set=launch._launch_hooks_set,
        lowrank_add=load().lowrank.lowrank_add_,
        swiglu=load().swiglu,
    )


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


def parse_cell(value: str):
    """A CSV cell back to int, float or str; an empty cell to None."""
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
    return [{k: parse_cell(v) for k, v in row.items()} for row in csv.DictReader(lines)]


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


# ---- rows and arguments --------------------------------------------------------------------------------------------


def parse_csv_arg(value: Optional[str]) -> Optional[list[str]]:
    """``"a,b"`` -> ``["a", "b"]``; None stays None (meaning: the default)."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def find_row(rows: list[dict], **key) -> Optional[dict]:
    """The first row with ``status == "ok"`` whose columns equal ``key``; None if there is none."""
    for row in rows:
        if row.get("status") == "ok" and all(row.get(k) == v for k, v in key.items()):
            return row
    return None


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``; None when either is missing or ``den`` is 0."""
    return None if num is None or den is None or den == 0 else num / den


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_name(k: int, n: int) -> str:
    """``"K->N"``: in_features -> out_features, the way every table names a layer shape."""
    return f"{k}->{n}"


def parse_shapes(value: Optional[str], arg: str = "--shapes") -> Optional[list[tuple[int, int]]]:
    """``"4096x14336,14336x4096"`` (or ``->`` instead of ``x``) -> ``[(4096, 14336), (14336, 4096)]``: (in, out)
    pairs; None stays None (meaning: the default)."""
    if value is None:
        return None
    shapes = []
    for item in parse_csv_arg(value):
        parts = item.replace("->", "x").split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"{arg}: expected IN x OUT items like '4096x14336', got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


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


def graph_time_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Mean microseconds per call of ``calls`` (closures), all captured in one CUDA graph that is replayed ``reps``
    times.

    Decoding streams every layer's weight once per token, so a weight is never in L2 when its matmul starts. Give
    ``calls`` one closure per copy of the weight, with enough copies to exceed the L2 (see [`copies_for`]), and the
    timing reads every weight from HBM, with launch overhead as in graph-captured decoding.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile / warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def copies_for(nbytes: int, l2_mb: float) -> int:
    """How many copies of an ``nbytes`` operand [`graph_time_us`] cycles over so that they overflow an L2 of
    ``l2_mb`` MiB three times."""
    return max(2, math.ceil(3 * l2_mb * 2**20 / nbytes))


def copy_bandwidth_gbps(device: Optional[torch.device] = None, nbytes: int = 2**30, warmup_ms: float = 20,
                        rep_ms: float = 60) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read + written (the run's "HBM bandwidth").

    ``device`` defaults to the current CUDA device.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
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


# ---- weights and layers --------------------------------------------------------------------------------------------

RANK = 16

# provider -> (quantization, tuner); quantization None means a bf16 nn.Linear. Run order: the ceiling, then PEFT's
# layers, then FastLoRA's, so that every ratio's baseline exists when a row is printed.
PROVIDERS = {
    "bf16-lora": (None, "peft"),
    "peft-bnb-nf4": ("nf4", "peft"),
    "peft-bnb-nf4-dq": ("nf4-dq", "peft"),
    "peft-bnb-int8": ("int8", "peft"),
    "fastlora-nf4": ("nf4", "fastlora"),
    "fastlora-nf4-dq": ("nf4-dq", "fastlora"),
    "fastlora-int8": ("int8", "fastlora"),
}
PEFT_TWIN = {"fastlora-nf4": "peft-bnb-nf4", "fastlora-nf4-dq": "peft-bnb-nf4-dq", "fastlora-int8": "peft-bnb-int8"}
ADAPTER_DTYPES = ("bf16", "fp32", "peft-default")


def weight_bytes(weight) -> int:
    """Bytes a kernel reads for a weight: a dense tensor's storage, or a ``Packed4bit``'s codes, scales and lookup
    tables, or an ``Int8Rowwise``'s codes and row scales."""
    from peft_fastlora.ops import Int8Rowwise

    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    if isinstance(weight, Int8Rowwise):
        tensors = [weight.cb, weight.scb]
    else:
        tensors = [weight.data, weight.absmax, weight.code, weight.nested_absmax, weight.nested_code]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def quantize_nf4(weight: torch.Tensor, nested: bool = True, blocksize: int = 64, quant_type: str = "nf4"):
    """``(Packed4bit, packed, quant_state)`` of ``weight`` quantized by bitsandbytes (bf16 or fp16 ``weight``)."""
    import bitsandbytes.functional as bnbF

    q, state = bnbF.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested,
                                  quant_storage=torch.uint8)  # fmt: skip
    return internals().packed4bit_from_bnb(q, state), q, state


def quantize_int8(weight: torch.Tensor):
    """``(Int8Rowwise, bnb Int8Params)`` of ``weight`` quantized row-wise by bitsandbytes on ``weight``'s device."""
    import bitsandbytes as bnb

    # Int8Params quantizes only when it moves from the CPU.
    param = bnb.nn.Int8Params(weight.to("cpu", torch.float16), requires_grad=False, has_fp16_weights=False)
    param = param.to(weight.device)
    return internals().int8_from_bnb(param), param


class OneLinear(nn.Module):
    """A model holding one linear layer ``proj``; ``dtype`` mirrors a transformers model loaded in bf16."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.proj = linear

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def forward(self, x):
        return self.proj(x)


def make_base_layer(weight: torch.Tensor, quant: Optional[str], device: torch.device, int8_threshold: float):
    """A bias-free linear layer holding ``weight`` (N, K): bf16 ``nn.Linear`` or bnb-quantized on ``device``."""
    n, k = weight.shape
    if quant is None:
        linear = nn.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16)
        linear.weight = nn.Parameter(weight.to(device, torch.bfloat16), requires_grad=False)
        return linear
    import bitsandbytes as bnb

    if quant in ("nf4", "nf4-dq"):
        nested = quant == "nf4-dq"
        linear = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, compress_statistics=nested,
                                   quant_type="nf4", quant_storage=torch.uint8, device="meta")  # fmt: skip
        linear.weight = bnb.nn.Params4bit(weight.to(device, torch.bfloat16), requires_grad=False, blocksize=64,
                                          compress_statistics=nested, quant_type="nf4", module=linear)  # fmt: skip
        return linear.to(device)  # bitsandbytes quantizes on .to(device)
    if quant == "int8":
        linear = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=int8_threshold,
                                     device="meta")  # fmt: skip
        # Int8Params quantizes only when it moves from the CPU.
        linear.weight = bnb.nn.Int8Params(weight.to("cpu", torch.float16), requires_grad=False, has_fp16_weights=False)
        return linear.to(device)
    raise ValueError(f"unknown quantization {quant!r}")


def base_weight_bytes(base: nn.Module, quant: Optional[str]) -> int:
    """[`weight_bytes`] of a layer from [`make_base_layer`]; call before its first forward (bnb int8 moves CB/SCB on
    forward)."""
    if quant is None:
        return weight_bytes(base.weight)
    if quant == "int8":
        return weight_bytes(internals().int8_from_bnb(base.weight))
    return weight_bytes(internals().packed4bit_from_bnb(base.weight.data, base.weight.quant_state))


def make_provider_layer(provider: str, weight: torch.Tensor, device: torch.device, int8_threshold: float = 6.0,
                        adapter_dtype: str = "bf16") -> tuple[nn.Module, int]:
    """The LoRA-wrapped layer of ``provider`` (r=[`RANK`], called directly, without PeftModel's wrappers) and the
    bytes of its base weight.

    ``adapter_dtype``: "bf16" or "fp32" gives every provider adapters of that dtype (a comparison of kernels);
    "peft-default" what ``get_peft_model`` gives (fp32 PEFT adapters, FastLoRA's ``adapter_dtype`` policy).
    """
    from peft import LoraConfig, get_peft_model

    import peft_fastlora

    if adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(f"adapter_dtype={adapter_dtype!r}: choose one of {ADAPTER_DTYPES}")
    quant, tuner = PROVIDERS[provider]
    base = make_base_layer(weight, quant, device, int8_threshold)
    nbytes = base_weight_bytes(base, quant)
    common = dict(r=RANK, lora_alpha=2 * RANK, target_modules=["proj"], lora_dropout=0.0, init_lora_weights=False)
    peft_default = adapter_dtype == "peft-default"
    if tuner == "fastlora":
        config = peft_fastlora.FastLoraConfig(**common, **({} if peft_default else {"adapter_dtype": adapter_dtype}))
        model = get_peft_model(OneLinear(base), config)
    else:
        model = get_peft_model(OneLinear(base), LoraConfig(**common), autocast_adapter_dtype=peft_default)
        if not peft_default:
            dtype = torch.float32 if adapter_dtype == "fp32" else torch.bfloat16
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(dtype)
    layer = model.base_model.model.proj
    if tuner == "fastlora" and not type(layer).__name__.startswith("FastLora"):
        raise RuntimeError(f"FastLoraConfig did not dispatch to a FastLoRA layer (got {type(layer).__name__})")
    return layer, nbytes


def lora_params(layer) -> list[torch.Tensor]:
    return [layer.lora_A["default"].weight, layer.lora_B["default"].weight]


def make_fn(layer, mode: str, m: int, k: int, n: int, device: torch.device) -> Callable[[], object]:
    """One call of ``layer`` on M random bf16 rows: ``infer`` = forward under ``torch.no_grad``, ``train`` = forward +
    backward (grads of x, LoRA A and B, through ``autograd.grad`` so that nothing accumulates between calls)."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    if mode == "infer":
        layer.eval()

        def infer():
            with torch.no_grad():
                return layer(x)

        return infer
    layer.train()
    x.requires_grad_(True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    inputs = [x, *lora_params(layer)]

    def train():
        return torch.autograd.grad(layer(x), inputs, dy)

    return train


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


# ---- profiler timeline: where the GPU waits ----------------------------------------------------------------------

# CUDA runtime calls that block the host until the device has caught up.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _phase(stack: list[str]) -> str:
    if any(name.startswith("Optimizer.") for name in stack):
        return "optimizer"
    if any(name.startswith("autograd::engine") or "Backward" in name for name in stack):
        return "backward"
    return "forward"


def timeline_lines(events, min_gap_us: float = 5.0, top: int = 15) -> list[str]:
    """Where the GPU idles during a profiled region (``torch.profiler`` events): step span, GPU busy time, idle time
    per phase (forward / backward / optimizer), the host operators running when each idle gap ended (the launch the
    GPU was waiting for) ranked by idle time, and every host sync call.

    A gap ends when the host launches the next kernel, so the operator on the host at that moment is the one the
    device waited for: ranking those by summed gap time shows which host work bounds a host-bound step.
    """
    from torch.autograd import DeviceType

    cpu, kernels = [], []
    for evt in events:
        entry = (evt.time_range.start, evt.time_range.end, evt.name)
        if evt.device_type == DeviceType.CUDA:
            kernels.append(entry)
        elif evt.device_type == DeviceType.CPU:
            cpu.append(entry)
    if not kernels or not cpu:
        return ["(no GPU or host events recorded)"]
    busy = _merge([(start, end) for start, end, _ in kernels])
    span_start = min(c[0] for c in cpu)
    span_end = max(max(c[1] for c in cpu), busy[-1][1])
    busy_us = sum(b - a for a, b in busy)
    gaps = [(span_start, busy[0][0])] + [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    gaps = [(a, b) for a, b in gaps if b - a >= min_gap_us]
    cpu.sort()
    starts = [c[0] for c in cpu]
    by_stack: dict[str, list[float]] = {}
    by_phase: dict[str, float] = {}
    for a, b in gaps:
        t = b - 0.5  # just before the kernel that ended the gap started
        hi = bisect.bisect_right(starts, t)
        stack = [c[2] for c in cpu[max(0, hi - 4000):hi] if c[1] >= t]
        ops = [n for n in stack if not n.startswith("cuda") and not n.startswith("cu")]
        key = " > ".join(ops[-3:]) or "(host idle or outside an operator)"
        entry = by_stack.setdefault(key, [0.0, 0])
        entry[0] += b - a
        entry[1] += 1
        phase = _phase(stack)
        by_phase[phase] = by_phase.get(phase, 0.0) + (b - a)
    span = span_end - span_start
    lines = [
        f"timeline: span {span / 1e3:.2f} ms, GPU busy {busy_us / 1e3:.2f} ms ({100 * busy_us / span:.0f} %), "
        f"idle gaps >= {min_gap_us:g} us: {len(gaps)} totalling {sum(b - a for a, b in gaps) / 1e3:.2f} ms",
        "idle by phase (ms): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(by_phase.items())),
        f"top {top} host operator stacks at the end of idle gaps (summed idle ms, gaps):",
    ]
    for key, (us, n) in sorted(by_stack.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  {n:5d}  {key[:150]}")
    # A replayed CUDA graph has no host operators to blame: the kernels either side of its largest gaps say where
    kernels.sort()
    kernel_starts = [k[0] for k in kernels]
    lines.append(f"largest {top} idle gaps (start ms into the span, idle ms, kernel before > kernel after):")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        i = bisect.bisect_left(kernel_starts, b)
        before = max((k for k in kernels[max(0, i - 64):i] if k[1] <= a + 0.5), default=None, key=lambda k: k[1])
        after = kernels[i] if i < len(kernels) else None
        names = " > ".join(k[2][:60] if k else "-" for k in (before, after))
        lines.append(f"  {(a - span_start) / 1e3:8.3f}  {(b - a) / 1e3:7.3f}  {names}")
    syncs: dict[str, list[float]] = {}
    for start, end, name in cpu:
        if name.startswith(SYNC_CALLS):
            hi = bisect.bisect_right(starts, start)
            parents = [c[2] for c in cpu[max(0, hi - 4000):hi] if c[1] >= end and not c[2].startswith("cuda")]
            key = f"{name} in {' > '.join(parents[-2:]) or '(top level)'}"
            entry = syncs.setdefault(key, [0.0, 0])
            entry[0] += end - start
            entry[1] += 1
    lines.append(f"host syncs: {sum(v[1] for v in syncs.values())}")
    for key, (us, n) in sorted(syncs.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  {n:5d}  {key[:150]}")
    return lines
