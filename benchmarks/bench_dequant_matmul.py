"""Dequant-in-the-matmul (``peft_fastlora.ops.dequant_matmul``) vs today's large-M path, Llama-3-8B shapes (issue #3).

Per weight shape (N, K) and token count M, bf16 activations, NF4 weight with double quantization (blocksize 64):

  fwd  y  = x (M, K) @ W.T      today: ``dequantize`` (one Triton launch, full W) + ``torch.mm(x, w.t())``
  dx   dx = g (M, N) @ W        today: ``dequantize`` + ``torch.mm(g, w)``

against the fused kernel (``dequant_matmul`` / ``dequant_matmul_t``) with its default tiling and, at ``--sweep-m``, a
short sweep of tilings (the best one of each shape is then also timed at the other M), and against cuBLAS on a dense
bf16 W (the ceiling: no dequantization at all). Every fused result is checked against today's path before it is timed;
a mismatch is recorded and never timed, so a wrong kernel cannot win.

Times are medians of ``triton.testing.do_bench`` (L2 flushed before every call); all numbers come from this run.
Outputs in ``--out``: dequant_matmul.csv (every measurement), dequant_matmul_summary.csv, dequant_matmul.png.

    python benchmarks/bench_dequant_matmul.py --out OUT_DIR            # ~1.5-2.5 min on an H100/H200 (compiles incl.)
    python benchmarks/bench_dequant_matmul.py --out OUT_DIR --quick    # one shape, one M, three tilings
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Optional

import _common as C
import torch

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out_features N, in_features K)
MS = [512, 2048, 8192]
COLUMNS = [
    "direction", "shape", "N", "K", "M", "provider", "config", "time_ms", "tflops", "speedup_vs_today",
    "ratio_to_dense", "max_abs_err", "status", "error",
]  # fmt: skip
SUMMARY_COLUMNS = [
    "direction", "shape", "M", "dense_ms", "today_ms", "fused_default_ms", "fused_best_ms", "best_config",
    "best_speedup_vs_today", "today_ratio_to_dense", "best_ratio_to_dense",
]  # fmt: skip
PLOT_SERIES = {"dense-bf16": "C0", "today": "C1", "fused-default": "C2", "fused-best": "C3"}


def sweep_configs():
    """Tilings tried at ``--sweep-m`` besides the default (128 x 128 x 64, swap_ab, 8 warps, 3 stages).

    One knob at a time around the default: MMA orientation, pipeline depth, BLOCK_K (decode work per step vs loop
    count), 256-wide tiles (the decoded W tile reused by twice the rows), 64-wide tiles with 4 warps, and the code
    table read in the loop (``lut_asm``) instead of staged through shared memory by the pipeliner. Every one compiles
    for sm_90 within shared memory (<= 146 KB) and registers (at most 8 bytes of spill, 128 x 256).
    """
    from peft_fastlora.ops.dequant_matmul import DequantMatmulConfig as Cfg

    return [
        Cfg(128, 128, 64, swap_ab=False, num_warps=8, num_stages=3),
        Cfg(128, 128, 64, swap_ab=True, num_warps=8, num_stages=4),
        Cfg(128, 128, 128, swap_ab=True, num_warps=8, num_stages=3),
        Cfg(128, 128, 32, swap_ab=True, num_warps=4, num_stages=4),
        Cfg(256, 128, 64, swap_ab=True, num_warps=8, num_stages=3),
        Cfg(128, 256, 64, swap_ab=True, num_warps=8, num_stages=3),
        Cfg(256, 128, 64, swap_ab=False, num_warps=8, num_stages=3),
        Cfg(64, 128, 64, swap_ab=True, num_warps=4, num_stages=4),
        Cfg(128, 64, 64, swap_ab=True, num_warps=4, num_stages=4),
        Cfg(128, 128, 64, swap_ab=True, num_warps=8, num_stages=3, lut_asm=True),
        Cfg(256, 128, 64, swap_ab=True, num_warps=8, num_stages=3, lut_asm=True),
    ]


def config_name(cfg) -> str:
    return (f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}g{cfg.group_m}{'-swap' if cfg.swap_ab else ''}"
            f"-w{cfg.num_warps}s{cfg.num_stages}{'-lutasm' if cfg.lut_asm else ''}")  # fmt: skip


def shape_name(n: int, k: int) -> str:
    return f"{n}x{k}"


def make_weight(n: int, k: int, device: torch.device):
    import bitsandbytes.functional as bnbF

    from peft_fastlora.bnb_weights import packed4bit_from_bnb

    # Unit-variance W (the scale of a real weight does not change the kernels' work): with x of unit-norm rows the
    # outputs are O(1), so the absolute tolerance of the correctness check is a couple of bf16 ulps, not the output.
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    q, state = bnbF.quantize_4bit(dense, blocksize=64, quant_type="nf4", compress_statistics=True,
                                  quant_storage=torch.uint8)  # fmt: skip
    return packed4bit_from_bnb(q, state)


class Bench:
    def __init__(self, args, device: torch.device, env: dict, out: Path):
        self.args, self.device, self.env = args, device, env
        self.rows: list[dict] = []
        self.log = C.CsvLog(out / "dequant_matmul.csv", COLUMNS, env)
        self.deadline = C.Deadline(args.budget_s)
        self.best: dict = {}  # (direction, shape) -> best sweep config at --sweep-m

    def record(self, row: dict) -> dict:
        self.rows.append(row)
        self.log.append(row)
        parts = [f"{row['direction']:3s} {row['shape']:11s} M={row.get('M') or '-':<5} {row['provider']:13s}",
                 f"{row.get('config') or '':30s}"]  # fmt: skip
        if row.get("status") == "ok":
            parts.append(f"{row['time_ms']:8.4f} ms {C.fmt(row.get('tflops'), 4):>7} TFLOP/s")
            if row.get("speedup_vs_today") is not None:
                parts.append(f"{row['speedup_vs_today']:.3f}x today")
        else:
            parts.append(f"[{row.get('status')}: {row.get('error')}]")
        print("  ".join(parts), flush=True)
        return row

    def time(self, base: dict, provider: str, fn, flops: int, config: str = "", ref=None, today=None) -> dict:
        """Times ``fn`` (after checking its output against ``ref`` when given) and records the row."""
        row = dict(base, provider=provider, config=config)
        if self.deadline.expired():
            return self.record(dict(row, status="skipped", error="time budget (--budget-s) used up"))
        try:
            if ref is not None:
                out = fn()
                row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # bf16: ~2 ulp of O(1) values
                del out
            t = C.bench_ms(fn, self.device, self.args.warmup, self.args.rep)
            row.update(time_ms=t, status="ok", tflops=flops / (t * 1e-3) / 1e12 if flops else None)
            if today is not None:
                row["speedup_vs_today"] = today / t
        except AssertionError as err:
            row.update(status="mismatch", error=C.short_error(err, 300))
        except Exception as err:
            row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
            if self.args.verbose:
                traceback.print_exc()
        return self.record(row)

    def run_shape(self, n: int, k: int, ms: list[int], sweep: list) -> None:
        from peft_fastlora.ops.dequant import dequantize

        bf16 = torch.bfloat16
        weight = make_weight(n, k, self.device)
        dense = dequantize(weight, bf16)  # the ceiling multiplies the same values, already dequantized
        base = dict(direction="-", shape=shape_name(n, k), N=n, K=k)
        self.time(base, "dequant-only", lambda: dequantize(weight, bf16), 0)
        for m in ms:
            x = torch.randn(m, k, device=self.device, dtype=bf16) / k**0.5
            self.run_case("fwd", weight, dense, x, sweep)
            g = torch.randn(m, n, device=self.device, dtype=bf16) / n**0.5
            self.run_case("dx", weight, dense, g, sweep)

    def run_case(self, direction: str, weight, dense: torch.Tensor, a: torch.Tensor, sweep: list) -> None:
        """Times ``a @ W.T`` (fwd) or ``a @ W`` (dx): dense, today, then the fused tilings (checked against today)."""
        from peft_fastlora.ops.dequant import dequantize
        from peft_fastlora.ops.dequant_matmul import dequant_matmul, dequant_matmul_t, pick_config

        (n, k), m, bf16 = weight.shape, a.shape[0], torch.bfloat16
        if direction == "fwd":
            today_fn = lambda: torch.mm(a, dequantize(weight, bf16).t())  # noqa: E731
            dense_fn = lambda: torch.mm(a, dense.t())  # noqa: E731
            fused_fn = lambda cfg: lambda: dequant_matmul(a, weight, None, cfg)  # noqa: E731
            default = pick_config(m, n, k, self.device)
        else:
            today_fn = lambda: torch.mm(a, dequantize(weight, bf16))  # noqa: E731
            dense_fn = lambda: torch.mm(a, dense)  # noqa: E731
            fused_fn = lambda cfg: lambda: dequant_matmul_t(a, weight, cfg)  # noqa: E731
            default = pick_config(m, k, n, self.device)
        shape = shape_name(n, k)
        base = dict(direction=direction, shape=shape, N=n, K=k, M=m)
        flops = 2 * m * n * k
        ref = today_fn()
        dense_row = self.time(base, "dense-bf16", dense_fn, flops)
        today_row = self.time(base, "today", today_fn, flops)
        candidates = [("fused-default", default)]
        if m == self.args.sweep_m:
            candidates += [("fused-sweep", cfg) for cfg in sweep if cfg != default]
        elif (direction, shape) in self.best and self.best[direction, shape] != default:
            candidates.append(("fused-best", self.best[direction, shape]))
        fused_rows = []
        for provider, cfg in candidates:
            row = self.time(base, provider, fused_fn(cfg), flops, config_name(cfg), ref, today_row.get("time_ms"))
            fused_rows.append((row, cfg))
        ok = [(row, cfg) for row, cfg in fused_rows if row.get("status") == "ok"]
        if m == self.args.sweep_m and ok:
            self.best[direction, shape] = min(ok, key=lambda item: item[0]["time_ms"])[1]
        dense_ms = dense_row.get("time_ms")
        for row in [today_row, *(row for row, _ in fused_rows)]:
            if row.get("status") == "ok" and dense_ms:
                row["ratio_to_dense"] = row["time_ms"] / dense_ms


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (direction, shape, M): today, fused default and fastest fused tiling, dense."""
    out = []
    keys = dict.fromkeys((r["direction"], r["shape"], r.get("M")) for r in rows if r["direction"] != "-")
    for direction, shape, m in keys:
        group = [r for r in rows if (r["direction"], r["shape"], r.get("M")) == (direction, shape, m)
                 and r.get("status") == "ok"]  # fmt: skip

        def ms_of(provider, group=group):
            found = [r["time_ms"] for r in group if r["provider"] == provider]
            return found[0] if found else None

        fused = [r for r in group if r["provider"].startswith("fused")]
        best = min(fused, key=lambda r: r["time_ms"]) if fused else {}
        today, dense = ms_of("today"), ms_of("dense-bf16")
        out.append(dict(direction=direction, shape=shape, M=m, dense_ms=dense, today_ms=today,
                        fused_default_ms=ms_of("fused-default"), fused_best_ms=best.get("time_ms"),
                        best_config=best.get("config"),
                        best_speedup_vs_today=None if not (today and best) else today / best["time_ms"],
                        today_ratio_to_dense=None if not (today and dense) else today / dense,
                        best_ratio_to_dense=None if not (best and dense) else best["time_ms"] / dense))  # fmt: skip
    return out


def plot(summary: list[dict], out: Path, env: dict) -> None:
    import matplotlib.pyplot as plt

    directions = [d for d in ("fwd", "dx") if any(s["direction"] == d for s in summary)]
    if not directions:
        return
    fig, axes = plt.subplots(len(directions), 1, figsize=(11, 4 * len(directions)), squeeze=False)
    for ax, direction in zip(axes[:, 0], directions):
        lines = [s for s in summary if s["direction"] == direction]
        groups = [f"{s['shape']}\nM={s['M']}" for s in lines]
        key = {"dense-bf16": "dense_ms", "today": "today_ms", "fused-default": "fused_default_ms",
               "fused-best": "fused_best_ms"}  # fmt: skip
        series = {name: [None if not s.get(col) else s["today_ms"] / s[col] if s.get("today_ms") else None
                         for s in lines] for name, col in key.items()}  # fmt: skip
        what = "y = x @ W.T" if direction == "fwd" else "dx = g @ W"
        C.grouped_bars(ax, groups, series, "speed vs today (higher is better)",
                       f"{what}, bf16 x, NF4 double-quant W: today = dequantize + cuBLAS", [(1.0, "today")],
                       colors=PLOT_SERIES)  # fmt: skip
        ax.legend(fontsize=7)
    C.save_figure(fig, out / "dequant_matmul.png", env)


def finalize(bench: Bench, out: Path, env: dict) -> None:
    summary: list[dict] = []

    def tables():
        summary.extend(summarize(bench.rows))
        C.print_table([r for r in bench.rows if r["provider"] == "dequant-only"], ["shape", "time_ms", "status"],
                      "== dequantize alone (part of today's time) ==")  # fmt: skip
        C.print_table(summary, SUMMARY_COLUMNS, "== summary: ms (lower is better); speedup > 1: fused beats today ==")

    steps = [
        ("csv", lambda: bench.log.rewrite(bench.rows)),
        ("tables", tables),
        ("summary csv", lambda: C.CsvLog(out / "dequant_matmul_summary.csv", SUMMARY_COLUMNS, env).rewrite(summary)),
        ("plot", lambda: plot(summary, out, env)),
    ]
    C.run_finalize_steps(steps)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/dequant_matmul"), help="output directory")
    p.add_argument("--quick", action="store_true", help="GPU smoke: 4096x4096, M=2048, default + 2 tilings")
    p.add_argument("--m", help=f"comma-separated token counts M (default {MS})")
    p.add_argument("--sweep-m", type=int, default=2048, help="M at which the tilings are swept (default 2048)")
    p.add_argument("--no-sweep", action="store_true", help="default tiling only")
    p.add_argument("--warmup", type=float, default=10, help="do_bench warmup ms")
    p.add_argument("--rep", type=float, default=40, help="do_bench repetition ms")
    p.add_argument("--budget-s", type=float, default=140, help="soft time budget: later work is recorded as skipped")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dequant_matmul needs a CUDA GPU (it times Triton kernels against cuBLAS); nothing to do here. "
              "The kernels' CPU (interpreter) tests: python -m pytest tests/ops/test_dequant_matmul.py",
              file=sys.stderr)  # fmt: skip
        return 2
    device = C.pick_device("cuda")
    shapes = SHAPES[:1] if args.quick else SHAPES
    ms = [int(m) for m in C.parse_csv_arg(args.m)] if args.m else ([2048] if args.quick else MS)
    sweep = [] if args.no_sweep else sweep_configs()[:2] if args.quick else sweep_configs()
    if args.quick:
        args.sweep_m = ms[0]
    ms = sorted(ms, key=lambda m: m != args.sweep_m)  # the sweep first: its best tiling is then timed at the other M
    torch.manual_seed(0)

    import bitsandbytes  # noqa: F401  (import everything before gc.freeze)

    import peft_fastlora.ops.dequant_matmul  # noqa: F401

    C.setup_run()
    args.out.mkdir(parents=True, exist_ok=True)
    env = C.env_info(device)
    env["run"] = (f"bench_dequant_matmul shapes={[shape_name(*s) for s in shapes]} M={ms} sweep_m={args.sweep_m} "
                  f"sweep={[config_name(c) for c in sweep]} bf16 x, nf4 double-quant blocksize 64; "
                  f"do_bench warmup={args.warmup}ms rep={args.rep}ms")  # fmt: skip
    C.print_header("bench_dequant_matmul: dequant-in-the-matmul vs dequantize + cuBLAS (issue #3)", env)
    bench = Bench(args, device, env, args.out)
    interrupted = False
    try:
        for n, k in shapes:
            bench.run_shape(n, k, ms, sweep)
            C.free_memory(device)
    except KeyboardInterrupt:
        interrupted = True
        print("\n!! interrupted: writing what was measured so far", flush=True)
    finalize(bench, args.out, env)
    print(f"\nbench_dequant_matmul {'interrupted' if interrupted else 'done'} after {bench.deadline.elapsed():.0f} s; "
          f"results in {args.out}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
