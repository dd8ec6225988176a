"""Quick GPU check of the Triton dequant and fused small-M kernels: bit-exactness vs bitsandbytes, then timings.

    python benchmarks/gpu_kernel_smoke.py            # checks + default tilings (~1-2 min)
    python benchmarks/gpu_kernel_smoke.py --sweep    # also a short sweep of tilings/layouts (~2 min)

Timing method. Decoding streams every layer's weight once per token, so a weight is never in L2 when its matmul
starts; timing one weight over and over would read it from L2 (H200: 50 MB). Each timed op therefore cycles over
enough independent copies of the weight to exceed ``--l2-mb`` x 3, all inside one CUDA graph (launch overhead as in
graph-captured decoding), and the time per call is the graph time divided by the number of calls.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out_features, in_features)


def graph_time_us(calls, reps: int = 20) -> float:
    """Mean microseconds per call of ``calls`` (a list of closures) replayed from one CUDA graph."""
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
    return max(2, math.ceil(3 * l2_mb * 2**20 / nbytes))


def quantize(shape, quant_type="nf4", nested=True, blocksize=64, dtype=torch.bfloat16):
    import bitsandbytes.functional as bnbF

    from peft_fastlora.bnb_weights import packed4bit_from_bnb

    w = torch.randn(shape, device="cuda", dtype=dtype)
    q, st = bnbF.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    return packed4bit_from_bnb(q, st), q, st


def weight_bytes(weight) -> int:
    from peft_fastlora.ops.quant_state import Packed4bit

    if isinstance(weight, Packed4bit):
        extra = [weight.absmax, weight.nested_absmax] if weight.nested else [weight.absmax]
        return (weight.numel + 1) // 2 + sum(t.numel() * t.element_size() for t in extra)
    return weight.cb.numel() + weight.scb.numel() * 4


def copy_bandwidth() -> float:
    """Device-to-device copy rate in GB/s (bytes read + written) of a 1 GiB buffer."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() / ms / 1e6


def check_bit_exact() -> None:
    import bitsandbytes.functional as bnbF

    from peft_fastlora.ops.dequant import dequantize_4bit, dequantize_int8
    from peft_fastlora.ops.quant_state import Int8Rowwise
    from peft_fastlora.ops.reference import dequantize_4bit_ref, dequantize_int8_ref

    print("\n## Bit-exactness on real shapes (vs bitsandbytes CUDA dequant in fp32 then cast, and vs reference)")
    for shape, (qt, nested, bs) in itertools.product(
        SHAPES, [("nf4", True, 64), ("nf4", False, 64), ("fp4", True, 128)]
    ):
        weight, q, st = quantize(shape, qt, nested, bs)
        st.dtype = torch.float32
        expected = bnbF.dequantize_4bit(q, st)
        ok = []
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            out = dequantize_4bit(weight, dtype)
            ok.append(torch.equal(out, expected.to(dtype)) and torch.equal(out, dequantize_4bit_ref(weight, dtype)))
        print(f"{qt} nested={nested!s:5} bs={bs:4} {shape!s:14} fp16/bf16/fp32: {['OK' if o else 'FAIL' for o in ok]}")
    for shape in SHAPES:
        cb, scb, _ = bnbF.int8_vectorwise_quant(torch.randn(shape, device="cuda", dtype=torch.float16))
        weight = Int8Rowwise(cb=cb, scb=scb)
        ok = [
            torch.equal(dequantize_int8(weight, d), dequantize_int8_ref(weight, d))
            and torch.equal(dequantize_int8(weight, d), bnbF.int8_vectorwise_dequant(cb, scb).to(d))
            for d in (torch.float16, torch.bfloat16, torch.float32)
        ]
        print(f"int8 {shape!s:14} fp16/bf16/fp32: {['OK' if o else 'FAIL' for o in ok]}")


def bench_dequant(copy_gbs: float, l2_mb: float, sweep: bool) -> None:
    print(f"\n## Dequant (graph-timed, cycling weights beyond L2). d2d copy = {copy_gbs:.0f} GB/s")
    print("| shape | out | ours us | ours GB/s | % of copy | bnb us | tiling |")
    print("|---|---|---|---|---|---|---|")
    for shape, dtype in itertools.product(SHAPES, (torch.bfloat16, torch.float32)):
        dequant_rows(shape, dtype, copy_gbs, l2_mb, sweep)
        torch.cuda.empty_cache()


def dequant_rows(shape, dtype: torch.dtype, copy_gbs: float, l2_mb: float, sweep: bool) -> None:
    import bitsandbytes.functional as bnbF

    from peft_fastlora.ops.dequant import _launch_dequant_4bit, dequantize_4bit

    base, _, _ = quantize(shape)
    traffic = weight_bytes(base) + base.numel * torch.empty((), dtype=dtype).element_size()
    copies = [quantize(shape) for _ in range(copies_for(traffic, l2_mb))]
    outs = [torch.empty(shape, dtype=dtype, device="cuda") for _ in copies]

    def ours(block_bytes=None, num_warps=8, layout=None):
        if block_bytes is None:
            return [lambda w=w, o=o: dequantize_4bit(w[0], dtype, out=o) for w, o in zip(copies, outs)]
        return [
            lambda w=w, o=o: _launch_dequant_4bit(w[0], None, o, block_bytes, num_warps, layout)
            for w, o in zip(copies, outs)
        ]

    for _, _, st in copies:
        st.dtype = dtype
    bnb_us = graph_time_us([lambda c=c: bnbF.dequantize_4bit(c[1], c[2]) for c in copies])
    tilings = [("default", ours())]
    if sweep and dtype == torch.bfloat16 and shape in DEQUANT_SWEEP_SHAPES:
        # layout 0: interleave + one wide store, 1: (bytes, 2) pairs stored without reshape, 2: per-element bytes
        for layout, bpt, nw in itertools.product((0, 1, 2), (4, 8, 16), (4, 8)):
            tilings.append((f"layout {layout}, {bpt} B/thread x {nw} warps", ours(bpt * 32 * nw, nw, layout)))
    for name, calls in tilings:
        us = graph_time_us(calls)
        gbs = traffic / us / 1e3
        row = f"| {shape} | {str(dtype)[6:]} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {bnb_us:.1f} |"
        print(f"{row} {name} |")


def bench_fused(copy_gbs: float, l2_mb: float, sweep: bool) -> None:
    print(
        f"\n## Fused small-M forward, bf16, LoRA r=16 (graph-timed, weights cycled beyond L2); copy {copy_gbs:.0f} GB/s"
    )
    print(
        "| shape (N, K) | M | ours us | base-only us | weight GB/s | % of copy | PEFT+bnb us | bnb base us | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, m in itertools.product(SHAPES, (1, 16)):
        fused_rows(shape, m, copy_gbs, l2_mb, sweep)
        torch.cuda.empty_cache()


def fused_rows(shape, m: int, copy_gbs: float, l2_mb: float, sweep: bool) -> None:
    import bitsandbytes as bnb

    from peft_fastlora.ops.fused_small_m import fused_lora_linear_small_m, pick_config

    r, dtype = 16, torch.bfloat16
    n_out, k = shape
    base, _, _ = quantize(shape)
    nbytes = weight_bytes(base)
    copies = [quantize(shape) for _ in range(copies_for(nbytes, l2_mb))]
    x = torch.randn(1, m, k, device="cuda", dtype=dtype) / math.sqrt(k)
    bias = torch.randn(n_out, device="cuda", dtype=dtype)
    a = torch.randn(r, k, device="cuda", dtype=dtype) / math.sqrt(k)
    b = torch.randn(n_out, r, device="cuda", dtype=dtype) / math.sqrt(r)

    def peft_bnb(q, st, lora):
        y = bnb.matmul_4bit(x, q.t(), quant_state=st, bias=bias)
        return y + F.linear(F.linear(x, a), b) * 2.0 if lora else y

    with torch.inference_mode():
        ours = graph_time_us([lambda c=c: fused_lora_linear_small_m(x, c[0], bias, a, b, 2.0) for c in copies])
        base_us = graph_time_us([lambda c=c: fused_lora_linear_small_m(x, c[0], None, None, None, 1.0) for c in copies])
        try:
            theirs = graph_time_us([lambda c=c: peft_bnb(c[1], c[2], True) for c in copies])
            theirs_base = graph_time_us([lambda c=c: peft_bnb(c[1], c[2], False) for c in copies])
        except Exception as e:  # report and go on
            print(f"(bnb baseline failed under CUDA graphs: {type(e).__name__}: {e})")
            theirs = theirs_base = float("nan")
    gbs = nbytes / base_us / 1e3
    print(
        f"| {shape} | {m} | {ours:.1f} | {base_us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {theirs:.1f} "
        f"| {theirs_base:.1f} | {theirs / ours:.2f}x |"
    )
    config = pick_config(m, n_out, k, x.device)
    print(f"  default config: {config}")
    if sweep and shape in SWEEP_SHAPES:
        sweep_fused(x.reshape(-1, k), copies, nbytes, config, copy_gbs)


SWEEP_SHAPES = [(4096, 4096)]
DEQUANT_SWEEP_SHAPES = [(4096, 4096), (14336, 4096)]


def sweep_fused(x2d, copies, nbytes: int, default, copy_gbs: float) -> None:
    """Times a grid of tilings (without bias/LoRA), then the best one with more warps / pipeline stages."""
    from dataclasses import replace

    from peft_fastlora.ops.fused_small_m import SmallMConfig, _launch

    def run(config):
        calls = [lambda w=w: _launch(x2d, w[0], None, None, None, 1.0, config) for w in copies]
        try:
            return graph_time_us(calls, reps=5)
        except Exception as e:  # e.g. out of shared memory or registers: report and go on
            print(f"  {config}: {type(e).__name__}: {str(e)[:80]}")
            return float("inf")

    use_dot = x2d.shape[0] > 1
    blocks = itertools.product((16, 32, 64), (128, 256)) if use_dot else itertools.product((8, 16), (512, 1024))
    grid = [SmallMConfig(use_dot, bn, bk, split) for (bn, bk) in blocks for split in sorted({1, default.split_k})]
    results = sorted(((run(c), c) for c in grid), key=lambda t: t[0])
    best = results[0][1]
    results += [(run(replace(best, num_warps=8)), replace(best, num_warps=8))]
    results += [(run(replace(best, num_stages=ns)), replace(best, num_stages=ns)) for ns in (2, 3)]
    for us, c in sorted(results, key=lambda t: t[0])[:6]:
        print(f"  sweep: {us:.1f} us = {100 * nbytes / us / 1e3 / copy_gbs:.0f}% of copy  {c}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel tilings")
    parser.add_argument("--l2-mb", type=float, default=50.0, help="L2 size to defeat (H200/H100: 50 MB)")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()

    import bitsandbytes
    import triton

    props = torch.cuda.get_device_properties(0)
    print(
        f"# {props.name}, {props.multi_processor_count} SMs | torch {torch.__version__} | triton {triton.__version__}"
        f" | bitsandbytes {bitsandbytes.__version__}"
    )
    torch.manual_seed(0)
    if not args.skip_checks:
        check_bit_exact()
    copy_gbs = copy_bandwidth()
    bench_dequant(copy_gbs, args.l2_mb, args.sweep)
    bench_fused(copy_gbs, args.l2_mb, args.sweep)


if __name__ == "__main__":
    main()
