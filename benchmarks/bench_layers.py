"""Layer-level benchmark: one LoRA linear layer on Llama-3-8B shapes, every provider measured in the same run.

Providers (each a one-layer module wrapped by ``get_peft_model``):
  bf16-lora        PEFT LoRA on a bf16 ``nn.Linear`` (the ceiling)
  peft-bnb-nf4     PEFT LoRA on ``bnb.nn.Linear4bit`` nf4, bf16 compute
  peft-bnb-nf4-dq  the same with double quantization
  peft-bnb-int8    PEFT LoRA on ``bnb.nn.Linear8bitLt`` (threshold as transformers' default, 6.0)
  fastlora-nf4, fastlora-nf4-dq, fastlora-int8   FastLoRA (``FastLoraConfig``) on the same bnb layers

Modes: ``infer`` (forward under ``torch.no_grad``) and ``train`` (forward + backward: grads of x, LoRA A and B).
Decode rows (infer, M <= 16) are also timed as a CUDA-graph replay, with the weight-read rate (quantized weight +
absmax bytes / time) next to the measured HBM (copy) bandwidth. The dequant section times
``peft_fastlora.ops.dequantize`` against ``bitsandbytes`` and a device-to-device copy of the output size.

Times are medians of ``triton.testing.do_bench`` (L2 flushed before every call). Ratios compare providers of the
same run only. Outputs in ``--out``: layers.csv, dequant.csv, layers_targets.csv, layers_*.png, dequant.png.

GPU:   python benchmarks/bench_layers.py --out benchmarks/results
CI:    python benchmarks/bench_layers.py --device cpu --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Optional

import _common as C
import torch
from torch import nn

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in_features K, out_features N) of Llama-3-8B
TINY_SHAPES = [(64, 96), (128, 64)]  # bnb's CPU 4-bit matmul needs in_features % 64 == 0
MS = [1, 16, 512, 2048, 8192]
QUICK_MS = [1, 16, 2048]
TINY_MS = [1, 16]
DECODE_MS = (1, 16)
RANK = 16

# provider -> (quantization, tuner); quantization None means a bf16 nn.Linear.
PROVIDERS = {
    "bf16-lora": (None, "peft"),
    "peft-bnb-nf4": ("nf4", "peft"),
    "peft-bnb-nf4-dq": ("nf4-dq", "peft"),
    "peft-bnb-int8": ("int8", "peft"),
    "fastlora-nf4": ("nf4", "fastlora"),
    "fastlora-nf4-dq": ("nf4-dq", "fastlora"),
    "fastlora-int8": ("int8", "fastlora"),
}
COLORS = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
FASTLORA = [p for p, (_, tuner) in PROVIDERS.items() if tuner == "fastlora"]
PEFT_TWIN = {"fastlora-nf4": "peft-bnb-nf4", "fastlora-nf4-dq": "peft-bnb-nf4-dq", "fastlora-int8": "peft-bnb-int8"}

LAYER_COLUMNS = [
    "shape", "K", "N", "mode", "M", "provider", "layer", "adapter_dtype", "time_ms", "graph_ms", "ratio_to_bf16",
    "graph_ratio_to_bf16", "speedup_vs_peft_bnb", "graph_speedup_vs_peft_bnb", "tflops", "weight_MB", "weight_GBps",
    "pct_hbm", "peak_extra_MiB", "status", "error",
]  # fmt: skip
DEQUANT_COLUMNS = [
    "shape", "K", "N", "variant", "impl", "time_ms", "read_MB", "write_MB", "GBps", "pct_copy", "speedup_vs_bnb",
    "status", "error",
]  # fmt: skip


def shape_name(k: int, n: int) -> str:
    return f"{k}->{n}"


def parse_shapes(value: Optional[str]) -> Optional[list[tuple[int, int]]]:
    if value is None:
        return None
    shapes = []
    for item in C.parse_csv_arg(value):
        parts = item.replace("->", "x").split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--shapes: expected IN x OUT items like '4096x14336', got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


# ---- building one layer --------------------------------------------------------------------------------------------


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


def quantized_bytes(container) -> int:
    """Bytes a kernel must read for a quantized weight: codes + scales (+ the small lookup tables)."""
    from peft_fastlora.ops import Int8Rowwise

    if isinstance(container, Int8Rowwise):
        tensors = [container.cb, container.scb]
    else:
        tensors = [container.data, container.absmax, container.code, container.nested_absmax, container.nested_code]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def weight_bytes(base: nn.Module, quant: Optional[str]) -> int:
    """Bytes of the base weight as stored; call before the first forward (bnb int8 moves CB/SCB on forward)."""
    from peft_fastlora.bnb_weights import int8_from_bnb, packed4bit_from_bnb

    if quant is None:
        return base.weight.numel() * base.weight.element_size()
    if quant == "int8":
        return quantized_bytes(int8_from_bnb(base.weight))
    return quantized_bytes(packed4bit_from_bnb(base.weight.data, base.weight.quant_state))


def make_provider_layer(provider: str, weight: torch.Tensor, device: torch.device, args) -> tuple[nn.Module, int]:
    """The LoRA-wrapped layer of ``provider`` (called directly, without PeftModel's wrappers) and its weight bytes."""
    from peft import LoraConfig, get_peft_model

    import peft_fastlora

    quant, tuner = PROVIDERS[provider]
    base = make_base_layer(weight, quant, device, args.int8_threshold)
    nbytes = weight_bytes(base, quant)
    common = dict(r=RANK, lora_alpha=2 * RANK, target_modules=["proj"], lora_dropout=0.0, init_lora_weights=False)
    peft_default = args.adapter_dtype == "peft-default"
    if tuner == "fastlora":
        config = peft_fastlora.FastLoraConfig(**common, **({} if peft_default else {"adapter_dtype": "bf16"}))
        model = get_peft_model(OneLinear(base), config)
    else:
        model = get_peft_model(OneLinear(base), LoraConfig(**common), autocast_adapter_dtype=peft_default)
        if not peft_default:  # bf16 adapters everywhere, so the comparison is of the kernels, not of adapter dtypes
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    layer = model.base_model.model.proj
    if tuner == "fastlora" and not type(layer).__name__.startswith("FastLora"):
        raise RuntimeError(f"FastLoraConfig did not dispatch to a FastLoRA layer (got {type(layer).__name__})")
    return layer, nbytes


# ---- measuring -----------------------------------------------------------------------------------------------------


def lora_params(layer) -> list[torch.Tensor]:
    return [layer.lora_A["default"].weight, layer.lora_B["default"].weight]


def make_fn(layer, mode: str, m: int, k: int, n: int, device: torch.device):
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

    def train():  # autograd.grad (not .backward) so nothing accumulates between calls
        return torch.autograd.grad(layer(x), inputs, dy)

    return train


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
        base_row = dict(shape=shape_name(k, n), K=k, N=n, provider=provider)
        skip_reason = "skipped: time budget (--budget-s) used up" if self.deadline.expired() else None
        if self.broken:
            skip_reason = "skipped: CUDA context broken by an earlier failure"
        layer = nbytes = None
        if skip_reason is None:
            try:
                layer, nbytes = make_provider_layer(provider, weight, self.device, self.args)
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
                       adapter_dtype=str(lora_params(layer)[0].dtype).replace("torch.", ""))  # fmt: skip
            fn = None
            try:
                fn = make_fn(layer, mode, m, k, n, self.device)
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
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        from peft_fastlora import ops
        from peft_fastlora.bnb_weights import int8_from_bnb, packed4bit_from_bnb

        a, dev = self.args, self.device
        base_row = dict(shape=shape_name(k, n), K=k, N=n)
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
                    param = bnb.nn.Int8Params(weight.to("cpu", torch.float16), requires_grad=False,
                                              has_fp16_weights=False).to(dev)  # fmt: skip
                    container = int8_from_bnb(param)
                    bnb_fn = lambda c=container: F.int8_vectorwise_dequant(c.cb, c.scb).to(torch.bfloat16)  # noqa: E731
                else:
                    q, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4",
                                               compress_statistics=variant == "nf4-dq", quant_storage=torch.uint8)
                    container = packed4bit_from_bnb(q, state)
                    bnb_fn = lambda q=q, s=state: F.dequantize_4bit(q, s)  # noqa: E731
            except Exception as err:
                for impl in ("fastlora", "bnb"):
                    row = dict(base_row, variant=variant, impl=impl, status="error",
                               error="quantize: " + C.short_error(err))  # fmt: skip
                    self.dq_rows.append(row)
                    self.dq_log.append(row)
                continue
            read = quantized_bytes(container)
            add(variant, "fastlora", read, lambda c=container: (lambda: ops.dequantize(c, torch.bfloat16)))
            add(variant, "bnb", read, lambda f=bnb_fn: f)
        C.free_memory(dev)


# ---- derived columns (ratios within this run) ----------------------------------------------------------------------


def _find(rows: list[dict], **key) -> Optional[dict]:
    for row in rows:
        if row.get("status") == "ok" and all(row.get(k) == v for k, v in key.items()):
            return row
    return None


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or den is None or den == 0 else num / den


def derive_layer_row(row: dict, rows: list[dict], hbm_gbps: Optional[float]) -> None:
    if row.get("status") != "ok":
        return
    key = dict(shape=row["shape"], mode=row["mode"], M=row["M"])
    bf16 = _find(rows, provider="bf16-lora", **key)
    row["ratio_to_bf16"] = _ratio(row["time_ms"], bf16 and bf16["time_ms"])
    row["graph_ratio_to_bf16"] = _ratio(row.get("graph_ms"), bf16 and bf16.get("graph_ms"))
    twin = _find(rows, provider=PEFT_TWIN.get(row["provider"]), **key)
    row["speedup_vs_peft_bnb"] = _ratio(twin and twin["time_ms"], row["time_ms"])
    row["graph_speedup_vs_peft_bnb"] = _ratio(twin and twin.get("graph_ms"), row.get("graph_ms"))
    if row["mode"] == "infer" and row["M"] in DECODE_MS and row.get("weight_MB"):
        t = row.get("graph_ms") or row["time_ms"]  # graph replay when captured: launch overhead removed
        row["weight_GBps"] = row["weight_MB"] * 1e6 / (t * 1e-3) / 1e9
        row["pct_hbm"] = None if not hbm_gbps else 100 * row["weight_GBps"] / hbm_gbps


def derive_dequant_row(row: dict, rows: list[dict]) -> None:
    if row.get("status") != "ok":
        return
    copy = _find(rows, shape=row["shape"], impl="copy")
    row["pct_copy"] = None if copy is None else 100 * row["GBps"] / copy["GBps"]
    if row["impl"] == "fastlora":
        bnb_row = _find(rows, shape=row["shape"], variant=row["variant"], impl="bnb")
        row["speedup_vs_bnb"] = _ratio(bnb_row and bnb_row["time_ms"], row["time_ms"])


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
        return _find(rows, provider=provider, shape=shape, mode="train", M=m)

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
            row = _find(dq_rows, shape=shape, variant=variant, impl="fastlora")
            checks.append(C.Check(f"dequant {variant} -> bf16: % of copy bandwidth", shape,
                                  row and row.get("pct_copy"), ">=", 85.0, "GB/s = (bytes read + written) / time"))
    for provider in FASTLORA:
        for m in DECODE_MS:
            for shape in shapes:
                row = _find(rows, provider=provider, shape=shape, mode="infer", M=m)
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
            series = {p: [(_find(rows, provider=p, shape=s, mode="train", M=m) or {}).get("ratio_to_bf16")
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
                found = [_find(rows, provider=p, shape=s, mode="infer", M=m) or {} for s in shapes]
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
            return (_find(dq_rows, **key) or {}).get("GBps")

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
                                            env, "== targets (kernels issue) ==")),
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
    p.add_argument("--sections", default="layers,dequant", help="layers,dequant")
    p.add_argument("--warmup", type=float, default=None, help="do_bench warmup ms (default 15; quick 8)")
    p.add_argument("--rep", type=float, default=None, help="do_bench repetition ms (default 50; quick 25)")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing of decode rows")
    p.add_argument("--adapter-dtype", default="bf16", choices=["bf16", "peft-default"],
                   help="bf16: every provider gets bf16 adapters (kernel comparison); peft-default: what "
                        "get_peft_model gives (fp32 PEFT adapters, FastLoRA's adapter_dtype policy)")
    p.add_argument("--int8-threshold", type=float, default=6.0, help="bnb Linear8bitLt outlier threshold")
    p.add_argument("--budget-s", type=float, default=None, help="soft time budget: later work is recorded as skipped")
    p.add_argument("--replot", action="store_true", help="only re-read the CSVs in --out and redo tables/targets/plots")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        rows, dq_rows = C.read_csv(out / "layers.csv"), C.read_csv(out / "dequant.csv")
        env = C.read_csv_header(out / "layers.csv")
        shapes = list(dict.fromkeys(r["shape"] for r in rows + dq_rows))
        hbm = C._parse(env.get("hbm_copy_GBps", ""))
        hbm = hbm if isinstance(hbm, (int, float)) else None
        finalize(rows, dq_rows, shapes, out, env, hbm)
        return 0

    device = C.pick_device(args.device)
    shapes = parse_shapes(args.shapes) or (TINY_SHAPES if args.tiny else SHAPES)
    ms = [int(m) for m in C.parse_csv_arg(args.m)] if args.m else (TINY_MS if args.tiny else QUICK_MS if args.quick
                                                                       else MS)  # fmt: skip
    providers = C.parse_csv_arg(args.providers) or list(PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; choose from {list(PROVIDERS)}")
    providers = [p for p in PROVIDERS if p in providers]  # bf16 first, PEFT before FastLoRA: live ratios work
    modes = C.parse_csv_arg(args.modes)
    sections = C.parse_csv_arg(args.sections)
    args.warmup = args.warmup if args.warmup is not None else (8 if args.quick else 15)
    args.rep = args.rep if args.rep is not None else (25 if args.quick else 50)
    torch.manual_seed(0)

    import bitsandbytes  # noqa: F401  (import everything before gc.freeze)
    import peft  # noqa: F401

    import peft_fastlora  # noqa: F401

    C.setup_run()
    env = C.env_info(device)
    env["run"] = (f"bench_layers shapes={[shape_name(*s) for s in shapes]} M={ms} modes={modes} providers={providers} "
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
    except KeyboardInterrupt:
        interrupted = True
        print("\n!! interrupted: writing what was measured so far", flush=True)
    finalize(bench.rows, bench.dq_rows, [shape_name(*s) for s in shapes], out, env, hbm, bench.log, bench.dq_log)
    print(f"\nbench_layers {'interrupted' if interrupted else 'done'} after {bench.deadline.elapsed():.0f} s; "
          f"results in {out}", flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
