"""Layer-level benchmark: one LoRA linear layer on Llama-3-8B shapes, every provider measured in the same run.

Providers (each a one-layer module wrapped by ``get_peft_model``, see ``_common.PROVIDERS``):
  bf16-lora        PEFT LoRA on a bf16 ``nn.Linear`` (the ceiling)
  peft-bnb-nf4     PEFT LoRA on ``bnb.nn.Linear4bit`` nf4, bf16 compute
  peft-bnb-nf4-dq  the same with double quantization
  peft-bnb-int8    PEFT LoRA on ``bnb.nn.Linear8bitLt`` (threshold as transformers' default, 6.0)
  fastlora-nf4, fastlora-nf4-dq, fastlora-int8   FastLoRA (``FastLoraConfig``) on the same bnb layers

Sections (``--sections``, default ``layers,dequant``):
  layers   modes ``infer`` (forward under ``torch.no_grad``) and ``train`` (forward + backward: grads of x, LoRA A and
           B) per shape, M and provider; decode rows (infer, M <= 16) also as a CUDA-graph replay, with the
           weight-read rate (quantized weight bytes / time) next to the measured HBM (copy) bandwidth.
  dequant  ``peft_fastlora.ops.dequantize`` against bitsandbytes and a device-to-device copy of the output size.
  kernels  the ops without the layer modules, as decoding runs them: the forward of ``fastlora_linear`` at M <= 16
           (the fused small-M kernel up to the GPU's tuned crossover) with and without LoRA, bitsandbytes'
           ``matmul_4bit`` with and without PEFT's LoRA matmuls, and the 4-bit dequant to bf16 and fp32. Each is
           captured in one CUDA graph cycling over enough weight copies to overflow ``--l2-mb``, so weights come from
           HBM (nf4 with double quantization, r=16, with bias).
  profile  ``torch.profiler`` of ``--profile-steps`` training calls (forward + backward) per provider, shape and M:
           the top kernels by GPU time (operators by CPU time without a GPU).

Layer times are medians of ``triton.testing.do_bench`` (L2 flushed before every call). Ratios compare providers of
the same run only. Outputs in ``--out``: layers.csv, dequant.csv, kernels.csv, layers_targets.csv, layers_train.png,
layers_decode.png, dequant.png, profile_*.txt.

GPU:   python benchmarks/bench_layers.py
CI:    python benchmarks/bench_layers.py --device cpu --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import _common as C
import torch

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in_features K, out_features N) of Llama-3-8B
TINY_SHAPES = [(64, 96), (128, 64)]  # bnb's CPU 4-bit matmul needs in_features % 64 == 0
MS = [1, 16, 512, 2048, 8192]
QUICK_MS = [1, 16, 2048]
TINY_MS = [1, 16]
DECODE_MS = (1, 16)
SECTIONS = ("layers", "dequant", "kernels", "profile")
RANK, PROVIDERS, PEFT_TWIN = C.RANK, C.PROVIDERS, C.PEFT_TWIN
COLORS = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
FASTLORA = [p for p, (_, tuner) in PROVIDERS.items() if tuner == "fastlora"]

LAYER_COLUMNS = [
    "shape", "K", "N", "mode", "M", "provider", "layer", "adapter_dtype", "time_ms", "graph_ms", "ratio_to_bf16",
    "graph_ratio_to_bf16", "speedup_vs_peft_bnb", "graph_speedup_vs_peft_bnb", "tflops", "weight_MB", "weight_GBps",
    "pct_hbm", "peak_extra_MiB", "status", "error",
]  # fmt: skip
# GBps: (weight bytes + output bytes for a dequant) / time; pct_hbm: of the measured copy bandwidth
KERNEL_COLUMNS = [
    "shape", "K", "N", "op", "M", "out_dtype", "impl", "us", "weight_MB", "GBps", "pct_hbm", "speedup_vs_bnb",
    "tiling", "copies", "status", "error",
]  # fmt: skip
# kernels section: impl -> the bitsandbytes impl it is compared with
KERNEL_TWIN = {"fastlora": "peft-bnb", "fastlora-base": "bnb-base", "fastlora-dequant": "bnb-dequant"}
DEQUANT_COLUMNS = [
    "shape", "K", "N", "variant", "impl", "time_ms", "read_MB", "write_MB", "GBps", "pct_copy", "speedup_vs_bnb",
    "status", "error",
]  # fmt: skip


# ---- layers -----------------------------------------------------------------------------------------------------


def peak_extra_mib(fn, device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


class LayerBench:
    def __init__(self, args, device: torch.device, env: dict, out: Path, hbm_gbps: Optional[float]):
        self.args, self.device, self.env, self.out, self.hbm = args, device, env, out, hbm_gbps
        self.rows: list[dict] = []
        self.dq_rows: list[dict] = []
        self.log = C.CsvLog(out / "layers.csv", LAYER_COLUMNS, env)
        self.dq_log = C.CsvLog(out / "dequant.csv", DEQUANT_COLUMNS, env)
        self.k_rows: list[dict] = []
        self.k_log = C.CsvLog(out / "kernels.csv", KERNEL_COLUMNS, env) if "kernels" in args.sections else None
        self.deadline = C.Deadline(args.budget_s)
        self.broken = False  # set if the CUDA context stops working; the rest is recorded as skipped

    # -- layers --
    def time_layer(self, fn, mode: str, m: int, provider: str) -> tuple[float, Optional[float], str]:
        a = self.args
        time_ms = C.bench_ms(fn, self.device, a.warmup, a.rep)
        graph_ms, note = None, ""
        decode = mode == "infer" and m in DECODE_MS and self.device.type == "cuda" and not a.no_graphs
        if decode and provider == "peft-bnb-int8" and a.int8_threshold > 0:
            note = "no CUDA graph: bnb int8 outlier threshold > 0 syncs with the host"
        elif decode:
            try:
                graph_ms = C.cuda_graph_ms(fn, a.warmup, a.rep)
            except Exception as err:
                note = "graph: " + C.short_error(err)
                self.broken = not C.cuda_healthy(self.device)
        return time_ms, graph_ms, note

    def record(self, row: dict) -> None:
        self.rows.append(row)
        self.log.append(row)

    def run_group(self, k: int, n: int, provider: str, cases: list[tuple[str, int]], weight: torch.Tensor,
                  counter: list[int], total: int) -> None:
        base_row = dict(shape=C.shape_name(k, n), K=k, N=n, provider=provider)
        skip_reason = "skipped: time budget (--budget-s) used up" if self.deadline.expired() else None
        if self.broken:
            skip_reason = "skipped: CUDA context broken by an earlier failure"
        layer = nbytes = None
        if skip_reason is None:
            try:
                layer, nbytes = C.make_provider_layer(provider, weight, self.device, self.args.int8_threshold,
                                                      self.args.adapter_dtype)
            except Exception as err:
                skip_reason = "error: build: " + C.short_error(err)
                if self.args.verbose:
                    traceback.print_exc()
        for mode, m in cases:
            counter[0] += 1
            row = dict(base_row, mode=mode, M=m)
            if skip_reason is None and self.deadline.expired():
                skip_reason = "skipped: time budget (--budget-s) used up"
            if skip_reason is not None:
                row.update(status=skip_reason.split(":")[0], error=skip_reason)
                self.record(row)
                self.print_row(row, counter[0], total)
                continue
            layer_cls = type(layer)
            row.update(layer=f"{layer_cls.__module__.rsplit('.', 1)[-1]}.{layer_cls.__name__}", weight_MB=nbytes / 1e6,
                       adapter_dtype=str(C.lora_params(layer)[0].dtype).replace("torch.", ""))  # fmt: skip
            fn = None
            try:
                fn = C.make_fn(layer, mode, m, k, n, self.device)
                time_ms, graph_ms, note = self.time_layer(fn, mode, m, provider)
                flops = (2 if mode == "infer" else 4) * m * n * k  # base matmul(s); backward computes dx, no dW
                row.update(time_ms=time_ms, graph_ms=graph_ms, tflops=flops / (time_ms * 1e-3) / 1e12,
                           peak_extra_MiB=peak_extra_mib(fn, self.device), status="ok", error=note)  # fmt: skip
            except Exception as err:
                row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
                if self.args.verbose:
                    traceback.print_exc()
                self.broken = self.broken or not C.cuda_healthy(self.device)
            del fn
            derive_layer_row(row, self.rows, self.hbm)
            self.record(row)
            self.print_row(row, counter[0], total)
        del layer
        C.free_memory(self.device)

    def print_row(self, row: dict, i: int, total: int) -> None:
        parts = [f"[{i:3d}/{total}] {row['mode']:5s} M={row['M']:<5d} {row['shape']:12s} {row['provider']:16s}"]
        if row.get("status") == "ok":
            parts.append(f"{row['time_ms']:9.4f} ms")
            if row.get("graph_ms") is not None:
                parts.append(f"graph {row['graph_ms'] * 1e3:8.1f} us, {C.fmt(row.get('weight_GBps'), 4)} GB/s")
            if row.get("ratio_to_bf16") is not None:
                parts.append(f"{row['ratio_to_bf16']:.3f}x bf16-lora")
            if row.get("speedup_vs_peft_bnb") is not None:
                parts.append(f"{row['speedup_vs_peft_bnb']:.2f}x faster than {PEFT_TWIN[row['provider']]}")
        parts.append("" if row.get("status") == "ok" and not row.get("error") else f"[{row.get('error')}]")
        print("  ".join(p for p in parts if p), flush=True)

    # -- dequant --
    def run_dequant_shape(self, k: int, n: int) -> None:
        import bitsandbytes.functional as F

        from peft_fastlora import ops

        a, dev = self.args, self.device
        base_row = dict(shape=C.shape_name(k, n), K=k, N=n)
        write = n * k * 2  # bf16 output
        weight = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02).contiguous()

        def add(variant: str, impl: str, read: int, make_fn) -> None:
            row = dict(base_row, variant=variant, impl=impl, read_MB=read / 1e6, write_MB=write / 1e6)
            if self.deadline.expired() or self.broken:
                row.update(status="skipped", error="skipped: time budget or broken CUDA context")
            else:
                try:
                    t = C.bench_ms(make_fn(), dev, a.warmup, a.rep)
                    row.update(time_ms=t, GBps=(read + write) / (t * 1e-3) / 1e9, status="ok")
                except Exception as err:
                    row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
                    if a.verbose:
                        traceback.print_exc()
            derive_dequant_row(row, self.dq_rows)
            self.dq_rows.append(row)
            self.dq_log.append(row)
            print(f"  dequant {row['shape']:12s} {variant:7s} {impl:9s} {C.fmt(row.get('time_ms'), 4):>9} ms  "
                  f"{C.fmt(row.get('GBps'), 4):>8} GB/s  {C.fmt(row.get('pct_copy'))}% of copy  "
                  f"{row.get('error') or ''}", flush=True)  # fmt: skip

        add("copy", "copy", write, lambda: (lambda: torch.empty_like(weight).copy_(weight)))
        for variant in ("nf4", "nf4-dq", "int8"):
            try:
                if variant == "int8":
                    container, _ = C.quantize_int8(weight)
                    bnb_fn = lambda c=container: F.int8_vectorwise_dequant(c.cb, c.scb).to(torch.bfloat16)  # noqa: E731
                else:
                    container, q, state = C.quantize_nf4(weight, nested=variant == "nf4-dq")
                    bnb_fn = lambda q=q, s=state: F.dequantize_4bit(q, s)  # noqa: E731
            except Exception as err:
                for impl in ("fastlora", "bnb"):
                    row = dict(base_row, variant=variant, impl=impl, status="error",
                               error="quantize: " + C.short_error(err))  # fmt: skip
                    self.dq_rows.append(row)
                    self.dq_log.append(row)
                continue
            read = C.weight_bytes(container)
            add(variant, "fastlora", read, lambda c=container: (lambda: ops.dequantize(c, torch.bfloat16)))
            add(variant, "bnb", read, lambda f=bnb_fn: f)
        C.free_memory(dev)


    # -- kernels: the ops, graph-captured over weight copies beyond the L2 --
    def time_calls_us(self, calls) -> float:
        if self.device.type == "cuda":
            return C.graph_time_us(calls, reps=self.args.graph_reps)
        for call in calls:  # CPU (smoke runs): wall time of the same calls, no graph
            call()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) * 1e6 / len(calls))
        return statistics.median(times)

    def run_kernels_shape(self, k: int, n: int, ms: list[int]) -> None:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        from peft_fastlora.ops import dequantize, fastlora_linear

        dev, r, scaling = self.device, RANK, 2.0
        base_row = dict(shape=C.shape_name(k, n), K=k, N=n)

        def weight():
            return (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5).contiguous()

        try:
            first = C.quantize_nf4(weight())
            nbytes = C.weight_bytes(first[0])
            count = C.copies_for(nbytes, self.args.l2_mb) if dev.type == "cuda" else 2
            copies = [first] + [C.quantize_nf4(weight()) for _ in range(count - 1)]
        except Exception as err:
            self.add_kernel_row(dict(base_row, op="quantize", status="error", error=C.short_error(err)))
            return
        a = torch.randn(r, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, r, device=dev, dtype=torch.bfloat16) / r**0.5
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)

        for out_dtype in (torch.bfloat16, torch.float32):
            dtype_name = str(out_dtype).replace("torch.", "")
            out_bytes = n * k * out_dtype.itemsize

            # bnb dequantizes to its quant state's dtype: a shallow copy of each state asks for out_dtype directly
            states = {id(c): copy.copy(c[2]) for c in copies}
            for state in states.values():
                state.dtype = out_dtype

            def bnb_dequant(c, states=states):
                return F.dequantize_4bit(c[1], states[id(c)])

            # baselines first, so that each FastLoRA row's speedup is known when it is printed
            cases = {"bnb-dequant": bnb_dequant,
                     "fastlora-dequant": lambda c, dtype=out_dtype: dequantize(c[0], dtype)}  # fmt: skip
            for impl, op in cases.items():
                row = dict(base_row, op="dequant", out_dtype=dtype_name, impl=impl, copies=len(copies))
                self.time_kernel(row, [lambda c=c, op=op: op(c) for c in copies], nbytes + out_bytes)
                row["weight_MB"] = nbytes / 1e6
        for m in [m for m in ms if m in DECODE_MS]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) / k**0.5

            def peft_bnb(c, lora, x=x):
                y = bnb.matmul_4bit(x, c[1].t(), quant_state=c[2], bias=bias)
                return y + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling if lora else y

            cases = {
                "peft-bnb": lambda c: peft_bnb(c, True),
                "bnb-base": lambda c: peft_bnb(c, False),
                "fastlora": lambda c, x=x: fastlora_linear(x, c[0], bias, a, b, scaling),
                "fastlora-base": lambda c, x=x: fastlora_linear(x, c[0], bias, None, None, 1.0),
            }
            tiling = None
            if dev.type == "cuda":
                tiling = str(C.internals().pick_small_m_config(m, n, k, dev, "nf4"))
            for impl, op in cases.items():
                row = dict(base_row, op="forward", M=m, out_dtype="bfloat16", impl=impl, copies=len(copies),
                           tiling=tiling if impl.startswith("fastlora") else None)  # fmt: skip
                with torch.inference_mode():
                    self.time_kernel(row, [lambda c=c, op=op: op(c) for c in copies], nbytes)
            del x
        del copies
        C.free_memory(dev)

    def time_kernel(self, row: dict, calls, traffic: int) -> None:
        """Times ``calls``; GB/s counts ``traffic`` bytes per call (weight read, plus the output for a dequant)."""
        row["weight_MB"] = traffic / 1e6
        if self.broken:
            row.update(status="skipped", error="skipped: CUDA context broken by an earlier failure")
        else:
            try:
                us = self.time_calls_us(calls)
                row.update(us=us, GBps=traffic / (us * 1e-6) / 1e9, status="ok")
                row["pct_hbm"] = None if not self.hbm else 100 * row["GBps"] / self.hbm
            except Exception as err:
                row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
                if self.args.verbose:
                    traceback.print_exc()
                self.broken = not C.cuda_healthy(self.device)
        self.add_kernel_row(row)

    def add_kernel_row(self, row: dict) -> None:
        twin = C.find_row(self.k_rows, shape=row["shape"], op=row.get("op"), M=row.get("M"),
                          out_dtype=row.get("out_dtype"), impl=KERNEL_TWIN.get(row.get("impl")))  # fmt: skip
        row["speedup_vs_bnb"] = C.ratio(twin and twin["us"], row.get("us"))
        self.k_rows.append(row)
        self.k_log.append(row)
        print(f"  kernels {row['shape']:12s} {row.get('op', ''):8s} M={C.fmt(row.get('M')):>3} "
              f"{C.fmt(row.get('out_dtype')):9s} {C.fmt(row.get('impl')):17s} {C.fmt(row.get('us'), 4):>8} us  "
              f"{C.fmt(row.get('GBps'), 4):>7} GB/s  {row.get('error') or ''}", flush=True)  # fmt: skip

    # -- profile --
    def run_profile(self, k: int, n: int, provider: str, m: int, weight: torch.Tensor) -> None:
        from torch.profiler import ProfilerActivity, profile

        a = self.args
        name = f"profile_{provider}_{k}x{n}_M{m}_train.txt"
        try:
            layer, _ = C.make_provider_layer(provider, weight, self.device, a.int8_threshold, a.adapter_dtype)
            fn = C.make_fn(layer, "train", m, k, n, self.device)
            for _ in range(3):
                fn()
            C.sync(self.device)
            cuda = self.device.type == "cuda"
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with profile(activities=activities) as prof:
                for _ in range(a.profile_steps):
                    fn()
                C.sync(self.device)
            table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                              row_limit=20, max_name_column_width=70)  # fmt: skip
            title = f"{provider} K={k} N={n} M={m} r={RANK}: {a.profile_steps} training calls (forward + backward)"
            header = "".join(f"# {line}\n" for line in C.header_lines(self.env))
            (self.out / name).write_text(f"{header}{title}\n{table}\n")
            print(f"  profile {title} -> {self.out / name}", flush=True)
        except Exception as err:
            print(f"  profile {provider} {k}x{n} M={m} failed: {C.short_error(err)}", flush=True)
            if a.verbose:
                traceback.print_exc()
        C.free_memory(self.device)


# ---- derived columns (ratios within this run) ----------------------------------------------------------------------


def derive_layer_row(row: dict, rows: list[dict], hbm_gbps: Optional[float]) -> None:
    if row.get("status") != "ok":
        return
    key = dict(shape=row["shape"], mode=row["mode"], M=row["M"])
    bf16 = C.find_row(rows, provider="bf16-lora", **key)
    row["ratio_to_bf16"] = C.ratio(row["time_ms"], bf16 and bf16["time_ms"])
    row["graph_ratio_to_bf16"] = C.ratio(row.get("graph_ms"), bf16 and bf16.get("graph_ms"))
    twin = C.find_row(rows, provider=PEFT_TWIN.get(row["provider"]), **key)
    row["speedup_vs_peft_bnb"] = C.ratio(twin and twin["time_ms"], row["time_ms"])
    row["graph_speedup_vs_peft_bnb"] = C.ratio(twin and twin.get("graph_ms"), row.get("graph_ms"))
    if row["mode"] == "infer" and row["M"] in DECODE_MS and row.get("weight_MB"):
        t = row.get("graph_ms") or row["time_ms"]  # graph replay when captured: launch overhead removed
        row["weight_GBps"] = row["weight_MB"] * 1e6 / (t * 1e-3) / 1e9
        row["pct_hbm"] = None if not hbm_gbps else 100 * row["weight_GBps"] / hbm_gbps


def derive_dequant_row(row: dict, rows: list[dict]) -> None:
    if row.get("status") != "ok":
        return
    copy = C.find_row(rows, shape=row["shape"], impl="copy")
    row["pct_copy"] = None if copy is None else 100 * row["GBps"] / copy["GBps"]
    if row["impl"] == "fastlora":
        bnb_row = C.find_row(rows, shape=row["shape"], variant=row["variant"], impl="bnb")
        row["speedup_vs_bnb"] = C.ratio(bnb_row and bnb_row["time_ms"], row["time_ms"])


def rederive(rows: list[dict], dq_rows: list[dict], hbm_gbps: Optional[float]) -> None:
    """Recomputes every ratio once all rows exist (a baseline may have been measured after a row)."""
    copy_first = sorted(dq_rows, key=lambda r: r.get("impl") != "copy")
    for row in copy_first:
        derive_dequant_row(row, copy_first)
    for row in rows:
        derive_layer_row(row, rows, hbm_gbps)


# ---- targets, tables, plots ----------------------------------------------------------------------------------------


def layer_targets(rows: list[dict], dq_rows: list[dict], shapes: list[str]) -> list[C.Check]:
    checks = []

    def train(provider, shape, m):
        return C.find_row(rows, provider=provider, shape=shape, mode="train", M=m)

    for m, limit in ((2048, 1.10), (8192, 1.03)):
        for provider in ("fastlora-nf4", "fastlora-nf4-dq"):
            for shape in shapes:
                row = train(provider, shape, m)
                checks.append(C.Check(f"train fwd+bwd M={m}: {provider} time / bf16-lora", shape,
                                      row and row["ratio_to_bf16"], "<=", limit,
                                      "" if provider == "fastlora-nf4" else "double quant (informational)"))
    for provider, twin in (("fastlora-nf4", "peft-bnb-nf4"), ("fastlora-nf4-dq", "peft-bnb-nf4-dq")):
        fast = [train(provider, s, 2048) for s in shapes]
        slow = [train(twin, s, 2048) for s in shapes]
        value = None
        if shapes and all(fast) and all(slow):
            value = sum(r["time_ms"] for r in slow) / sum(r["time_ms"] for r in fast)
        checks.append(C.Check(f"train fwd+bwd M=2048: {twin} / {provider} (all shapes summed)", "+".join(shapes),
                              value, ">=", 1.5, "" if provider == "fastlora-nf4" else "informational"))
    for m in (2048, 8192):
        for shape in shapes:
            row = train("fastlora-int8", shape, m)
            checks.append(C.Check(f"train fwd+bwd M={m}: fastlora-int8 time / bf16-lora", shape,
                                  row and row["ratio_to_bf16"], "<=", 1.15))
    for variant in ("nf4", "nf4-dq", "int8"):
        for shape in shapes:
            row = C.find_row(dq_rows, shape=shape, variant=variant, impl="fastlora")
            checks.append(C.Check(f"dequant {variant} -> bf16: % of copy bandwidth", shape,
                                  row and row.get("pct_copy"), ">=", 85.0, "GB/s = (bytes read + written) / time"))
    for provider in FASTLORA:
        for m in DECODE_MS:
            for shape in shapes:
                row = C.find_row(rows, provider=provider, shape=shape, mode="infer", M=m)
                graph = row is not None and row.get("graph_speedup_vs_peft_bnb") is not None
                value = row and (row["graph_speedup_vs_peft_bnb"] if graph else row.get("speedup_vs_peft_bnb"))
                checks.append(C.Check(f"decode M={m}: {PEFT_TWIN[provider]} time / {provider} time (>1 = faster)",
                                      shape, value, ">=", 1.0, "CUDA graphs" if graph else "eager"))
                timing = "CUDA graph" if row is not None and row.get("graph_ms") is not None else "eager"
                checks.append(C.Check(f"decode M={m}: {provider} weight-read rate, % of measured HBM", shape,
                                      row and row.get("pct_hbm"), ">=", 60.0, timing))
    return checks


def print_tables(rows: list[dict], dq_rows: list[dict], hbm: Optional[float]) -> None:
    cols = ["shape", "M", "provider", "time_ms", "ratio_to_bf16", "speedup_vs_peft_bnb", "tflops", "peak_extra_MiB",
            "status"]  # fmt: skip
    for mode, title in (("train", "training forward+backward (x, A, B grads)"), ("infer", "inference forward")):
        sel = [r for r in rows if r.get("mode") == mode]
        sel.sort(key=lambda r: r["M"])  # stable: shapes and providers stay in run order
        if sel:
            C.print_table(sel, cols, f"== layers: {title}; ratio_to_bf16 = time / bf16-lora time (same run) ==")
    dec = [r for r in rows if r.get("mode") == "infer" and r.get("M") in DECODE_MS]
    if dec:
        C.print_table(sorted(dec, key=lambda r: r["M"]),
                      ["shape", "M", "provider", "time_ms", "graph_ms", "graph_ratio_to_bf16",
                       "graph_speedup_vs_peft_bnb", "weight_MB", "weight_GBps", "pct_hbm", "error"],
                      f"== decode (CUDA graph replay); measured HBM copy bandwidth: {C.fmt(hbm, 4)} GB/s ==")
    if dq_rows:
        C.print_table(dq_rows, ["shape", "variant", "impl", "time_ms", "read_MB", "write_MB", "GBps", "pct_copy",
                                "speedup_vs_bnb", "status"],
                      "== dequantize -> bf16; GB/s = (quantized bytes read + bf16 bytes written) / time, "
                      "copy: (2 x output bytes) / time ==")


def plot_all(rows: list[dict], dq_rows: list[dict], shapes: list[str], out: Path, env: dict,
             hbm: Optional[float]) -> None:
    import matplotlib.pyplot as plt

    providers = [p for p in PROVIDERS if any(r.get("provider") == p for r in rows)]
    train_ms = [m for m in (2048, 8192) if any(r.get("M") == m and r.get("mode") == "train" for r in rows)]
    if train_ms and providers:
        fig, axes = plt.subplots(1, len(train_ms), figsize=(6.5 * len(train_ms), 4.2), squeeze=False)
        for ax, m, limit in zip(axes[0], train_ms, [1.10 if m == 2048 else 1.03 for m in train_ms]):
            series = {p: [(C.find_row(rows, provider=p, shape=s, mode="train", M=m) or {}).get("ratio_to_bf16")
                          for s in shapes] for p in providers}  # fmt: skip
            C.grouped_bars(ax, shapes, series, "time / bf16-lora (lower is better)",
                           f"training fwd+bwd, M={m}, r={RANK}", [(1.0, "bf16-lora"), (limit, f"target {limit}")],
                           colors=COLORS)
        axes[0][0].legend(fontsize=7)
        C.save_figure(fig, out / "layers_train.png", env)
    dec_ms = [m for m in DECODE_MS if any(r.get("M") == m and r.get("mode") == "infer" for r in rows)]
    if dec_ms and providers:
        fig, axes = plt.subplots(2, len(dec_ms), figsize=(6.5 * len(dec_ms), 7.5), squeeze=False)
        for j, m in enumerate(dec_ms):
            t_series, bw_series = {}, {}
            for p in providers:
                found = [C.find_row(rows, provider=p, shape=s, mode="infer", M=m) or {} for s in shapes]
                t_series[p] = [None if not r else 1e3 * (r.get("graph_ms") or r["time_ms"]) for r in found]
                bw_series[p] = [r.get("weight_GBps") for r in found]
            C.grouped_bars(axes[0][j], shapes, t_series, "us per call (CUDA graph replay when captured)",
                           f"decode forward, M={m}", colors=COLORS)
            lines = [] if not hbm else [(hbm, "measured HBM (copy)"), (0.6 * hbm, "60% target")]
            C.grouped_bars(axes[1][j], shapes, bw_series, "weight bytes read / time (GB/s)",
                           f"weight-read rate, M={m}", lines, colors=COLORS)
        axes[0][0].legend(fontsize=7)
        C.save_figure(fig, out / "layers_decode.png", env)
    if dq_rows:
        fig, ax = plt.subplots(figsize=(9, 4.2))
        names = []
        for r in dq_rows:
            name = r["impl"] if r["impl"] == "copy" else f"{r['impl']}-{r['variant']}"
            if name not in names:
                names.append(name)

        def gbps(shape, name):
            impl, _, variant = name.partition("-")
            key = dict(shape=shape, impl=impl) if impl == "copy" else dict(shape=shape, impl=impl, variant=variant)
            return (C.find_row(dq_rows, **key) or {}).get("GBps")

        C.grouped_bars(ax, shapes, {n: [gbps(s, n) for s in shapes] for n in names},
                       "GB/s (bytes read + written)", "dequantize -> bf16 vs device copy of the output size")
        ax.legend(fontsize=7, ncol=2)
        C.save_figure(fig, out / "dequant.png", env)


def finalize(bench_rows, dq_rows, shapes, out, env, hbm, log=None, dq_log=None) -> None:
    steps = [
        ("ratios", lambda: rederive(bench_rows, dq_rows, hbm)),
        ("csv", lambda: (log.rewrite(bench_rows), dq_log.rewrite(dq_rows)) if log else None),
        ("tables", lambda: print_tables(bench_rows, dq_rows, hbm)),
        ("targets", lambda: C.write_targets(layer_targets(bench_rows, dq_rows, shapes), out / "layers_targets.csv",
                                            env, "== layer targets ==")),
        ("plots", lambda: plot_all(bench_rows, dq_rows, shapes, out, env, hbm)),
    ]
    C.run_finalize_steps(steps)


# ---- main ----------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (64->96, 128->64), M in {1,16}: CI smoke run")
    p.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS}, shorter timing")
    p.add_argument("--shapes", help="IN x OUT list, e.g. '4096x4096,4096x14336' (default: Llama-3-8B's three)")
    p.add_argument("--m", help=f"comma-separated token counts M (default {MS})")
    p.add_argument("--providers", help=f"comma-separated subset of {list(PROVIDERS)}")
    p.add_argument("--modes", default="train,infer", help="train,infer")
    p.add_argument("--sections", default="layers,dequant", help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--warmup", type=float, default=None, help="do_bench warmup ms (default 15; quick 8)")
    p.add_argument("--rep", type=float, default=None, help="do_bench repetition ms (default 50; quick 25)")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing of decode rows")
    p.add_argument("--adapter-dtype", default="bf16", choices=list(C.ADAPTER_DTYPES),
                   help="bf16 / fp32: every provider gets adapters of that dtype (kernel comparison); peft-default: "
                        "what get_peft_model gives (fp32 PEFT adapters, FastLoRA's adapter_dtype policy)")
    p.add_argument("--int8-threshold", type=float, default=6.0, help="bnb Linear8bitLt outlier threshold")
    p.add_argument("--l2-mb", type=float, default=50.0, help="kernels section: L2 size to overflow (H100/H200: 50 MB)")
    p.add_argument("--graph-reps", type=int, default=20, help="kernels section: graph replays per timing")
    p.add_argument("--profile-steps", type=int, default=10, help="profile section: training calls profiled")
    p.add_argument("--budget-s", type=float, default=None,
                   help="optional soft time budget (seconds): work that would start later is recorded as skipped")
    p.add_argument("--replot", action="store_true", help="only re-read the CSVs in --out and redo tables/targets/plots")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:  # a run with only some sections has only some CSVs
        rows, dq_rows = [C.read_csv(out / f) if (out / f).exists() else [] for f in ("layers.csv", "dequant.csv")]
        env = C.read_csv_header(out / ("layers.csv" if (out / "layers.csv").exists() else "dequant.csv"))
        shapes = list(dict.fromkeys(r["shape"] for r in rows + dq_rows))
        hbm = C.parse_cell(env.get("hbm_copy_GBps", ""))
        hbm = hbm if isinstance(hbm, (int, float)) else None
        finalize(rows, dq_rows, shapes, out, env, hbm)
        return 0

    device = C.pick_device(args.device)
    shapes = C.parse_shapes(args.shapes) or (TINY_SHAPES if args.tiny else SHAPES)
    ms = [int(m) for m in C.parse_csv_arg(args.m)] if args.m else (TINY_MS if args.tiny else QUICK_MS if args.quick
                                                                       else MS)  # fmt: skip
    providers = C.parse_csv_arg(args.providers) or list(PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; choose from {list(PROVIDERS)}")
    providers = [p for p in PROVIDERS if p in providers]  # bf16 first, PEFT before FastLoRA: live ratios work
    modes = C.parse_csv_arg(args.modes)
    sections = C.parse_csv_arg(args.sections)
    if not set(sections) <= set(SECTIONS):
        raise SystemExit(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    args.sections = sections
    args.warmup = args.warmup if args.warmup is not None else (8 if args.quick else 15)
    args.rep = args.rep if args.rep is not None else (25 if args.quick else 50)
    torch.manual_seed(0)

    import bitsandbytes  # noqa: F401  (import everything before gc.freeze)
    import peft  # noqa: F401

    import peft_fastlora  # noqa: F401

    C.setup_run()
    env = C.env_info(device)
    env["run"] = (f"bench_layers shapes={[C.shape_name(*s) for s in shapes]} M={ms} modes={modes} "
                  f"providers={providers} sections={sections} "
                  f"r={RANK} adapters={args.adapter_dtype} int8_threshold={args.int8_threshold} "
                  f"do_bench warmup={args.warmup}ms rep={args.rep}ms")  # fmt: skip
    hbm = None
    if device.type == "cuda":
        hbm = C.copy_bandwidth_gbps(device, warmup_ms=args.warmup, rep_ms=args.rep)
    env["hbm_copy_GBps"] = C.fmt(hbm, 5)
    C.print_header("bench_layers: LoRA linear layer, Llama-3-8B shapes (times compare providers of THIS run)", env)

    bench = LayerBench(args, device, env, out, hbm)
    # Cases by priority, so a run cut short still has the target rows: pass 1 = the targets' rows, pass 2 = the rest.
    first = [("train", m) for m in (2048, 8192)] + [("infer", m) for m in DECODE_MS]
    everything = [(mode, m) for mode in ("train", "infer") for m in ms]
    passes = [[c for c in first if c in everything], [c for c in everything if c not in first]]
    passes = [[c for c in p if c[0] in modes] for p in passes]
    total = sum(len(p) for p in passes) * len(shapes) * len(providers) if "layers" in sections else 0
    counter = [0]
    interrupted = False
    try:
        for i, cases in enumerate(passes):
            if "layers" in sections and cases:
                print(f"\n-- layers pass {i + 1}: {cases}", flush=True)
                for k, n in shapes:
                    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                    for provider in providers:
                        bench.run_group(k, n, provider, cases, weight, counter, total)
                    del weight
            if i == 0 and "dequant" in sections:
                print("\n-- dequant", flush=True)
                for k, n in shapes:
                    bench.run_dequant_shape(k, n)
            if i == 0 and "kernels" in sections:
                print(f"\n-- kernels (one CUDA graph over weight copies beyond {args.l2_mb:g} MB of L2)", flush=True)
                for k, n in shapes:
                    bench.run_kernels_shape(k, n, ms)
        if "profile" in sections:
            print("\n-- profile (training calls)", flush=True)
            for k, n in shapes:
                weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                for provider in providers:
                    for m in ms:
                        bench.run_profile(k, n, provider, m, weight)
                del weight
    except KeyboardInterrupt:
        interrupted = True
        print("\n!! interrupted: writing what was measured so far", flush=True)
    finalize(bench.rows, bench.dq_rows, [C.shape_name(*s) for s in shapes], out, env, hbm, bench.log, bench.dq_log)
    if bench.k_rows:
        C.print_table(bench.k_rows, ["shape", "op", "M", "out_dtype", "impl", "us", "GBps", "pct_hbm",
                                     "speedup_vs_bnb", "tiling", "status"],
                      "== kernels: us per call, graph-captured over weight copies (speedup: bnb time / this) ==")
    print(f"\nbench_layers {'interrupted' if interrupted else 'done'} after {bench.deadline.elapsed():.0f} s; "
          f"results in {out}", flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
