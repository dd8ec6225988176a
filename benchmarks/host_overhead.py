"""Host (CPU) time per layer call: what the GPU waits on when the batch is small (decode, batch-1 training).

    python benchmarks/host_overhead.py [--out benchmarks/results]

For a small layer (default 512x512, so GPU work is a few microseconds and never the bottleneck) it times many calls
queued back to back and divides the wall time by the number of calls: that is the host time per call. Providers as in
bench_layers.py (bf16 LoRA, PEFT+bnb nf4/int8, FastLoRA nf4/int8), modes ``decode`` (M=1, no grad) and ``train``
(M=16, forward + backward under bf16 autocast). Also times the building blocks (one ``torch.mm``, one cached Triton
dequant launch, bitsandbytes' dequant) and prints a cProfile of FastLoRA's calls. Host time depends on the CPU and
its load: compare providers (or commits) measured in the same run only. Writes host_overhead.csv.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import _common as C
import torch


def host_us(fn, calls: int = 300, repeats: int = 5) -> float:
    """Median over ``repeats`` of (wall time of ``calls`` queued calls + one sync) / ``calls``, in microseconds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def layer_fn(layer, mode: str, k: int, n: int, device: torch.device):
    if mode == "decode":
        return C.make_fn(layer, "infer", 1, k, n, device)  # one row, no grad
    # Unlike bench_layers' train mode: 16 rows under bf16 autocast, as in a training step.
    layer.train()
    x = torch.randn(16, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, n, device=device, dtype=torch.bfloat16)
    inputs = [x, *C.lora_params(layer)]

    def train():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        return torch.autograd.grad(y, inputs, dy)

    return train


def profile_top(fn, calls: int = 300, limit: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(limit)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    parser.add_argument("--int8-threshold", type=float, default=0.0, help="bnb Linear8bitLt outlier threshold")
    parser.add_argument("--adapter-dtype", default="bf16", choices=list(C.ADAPTER_DTYPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_overhead.py measures CUDA launch overhead: it needs a GPU.")
        return 2
    import bitsandbytes.functional as bnbF

    from peft_fastlora.ops import dequantize

    device = torch.device("cuda")
    env = C.env_info(device)
    C.print_header("Host time per call", env)
    k, n = args.k, args.n
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    rows = []

    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    packed, q, state = C.quantize_nf4(weight)
    blocks = {
        "torch.mm 64x64": lambda: torch.mm(a, a),
        "FastLoRA dequant (cached launch)": lambda: dequantize(packed, torch.bfloat16),
        "bnb dequantize_4bit": lambda: bnbF.dequantize_4bit(q, state),
    }
    for name, fn in blocks.items():
        rows.append({"what": name, "mode": "-", "host_us": host_us(fn)})
    rows.append({"what": "launch cache entries", "mode": "-", "host_us": float(C.internals().launch_cache_size())})
    rows.append({"what": "launch hooks set", "mode": "-", "host_us": float(C.internals().launch_hooks_set())})

    profiles = {}
    for provider in ("bf16-lora", "peft-bnb-nf4", "fastlora-nf4", "peft-bnb-int8", "fastlora-int8"):
        layer, _ = C.make_provider_layer(provider, weight, device, args.int8_threshold, args.adapter_dtype)
        for mode in ("decode", "train"):
            fn = layer_fn(layer, mode, k, n, device)
            rows.append({"what": provider, "mode": mode, "host_us": host_us(fn)})
            print(f"{provider:>14} {mode:>6}: {rows[-1]['host_us']:7.1f} us/call", flush=True)
            if provider.startswith("fastlora"):
                profiles[f"{provider} {mode}"] = profile_top(fn)
        del layer
    C.print_table(rows, ["what", "mode", "host_us"], title=f"host time per call ({k}x{n})")
    args.out.mkdir(parents=True, exist_ok=True)
    C.CsvLog(args.out / "host_overhead.csv", ["what", "mode", "host_us"], env).rewrite(rows)
    for name, text in profiles.items():
        print(f"== cProfile: {name} (300 calls)\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
