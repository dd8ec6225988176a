"""GPU smoke benchmark of the FastLoRA training op against the bf16 ceiling at Llama-3-8B shapes.

Times forward and forward+backward (x and both adapters need grads, the base weight is frozen) of

- ``ceiling``: plain bf16 ``F.linear(x, W) + F.linear(F.linear(x, A), B) * scaling`` (W already dequantized),
- ``fastlora``: ``peft_fastlora.ops.fastlora_linear`` on the NF4 (double-quantized) weight, bf16 adapters,
- ``fastlora-fp32A``: the same with fp32 adapters (the GradScaler-friendly layout),
- ``fastlora-int8``: the same on an int8 row-scaled weight,
- ``bnb``: bitsandbytes' own ``matmul_4bit`` + the same LoRA (what PEFT's Linear4bit runs), when available,

with ``triton.testing.do_bench`` (median ms), and checks the target fwd+bwd <= 1.10x the ceiling at M=2048. The
``host`` column is the CPU time of one fwd+bwd (ms, see ``host_ms``): where it exceeds the GPU time, the op is
launch-bound.

Usage (on a CUDA machine): ``python benchmarks/gpu_ops_smoke.py [--m 2048 8192] [--r 16]``
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from peft_fastlora.bnb_weights import packed4bit_from_bnb
from peft_fastlora.ops import Int8Rowwise, dequantize, fastlora_linear

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in_features K, out_features N)
TARGET_M, TARGET_RATIO = 2048, 1.10


def bench(fn, grad_to_none) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, grad_to_none=grad_to_none, return_mode="median")


def host_ms(fn, leaves, iters: int = 30) -> float:
    """CPU time per call of ``fn`` (Python + launches): ``iters`` calls queued without a sync, then one sync.

    ``iters`` is small enough that the launch queue never fills, so the loop never waits for the GPU.
    """
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        for t in leaves:
            t.grad = None
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3 / iters


def time_variant(forward, x, params, grad):
    """(fwd ms, fwd+bwd ms, fwd+bwd host ms) of ``forward(x)``; grads of ``x`` and ``params`` are reset between runs."""
    leaves = [x, *params]
    fwd = bench(lambda: forward(x), leaves)
    fwd_bwd = bench(lambda: forward(x).backward(grad), leaves)
    return fwd, fwd_bwd, host_ms(lambda: forward(x).backward(grad), leaves)


def make_variants(k, n, m, r, scaling, weights, device="cuda", dtype=torch.bfloat16):
    """``{name: (forward(x), trainable params)}`` for one shape; ``weights`` from [`make_weights`]."""
    import bitsandbytes as bnb

    nf4, int8, w_bf16, (q, state) = weights
    a16 = (torch.randn(r, k, device=device) / k**0.5).to(dtype).requires_grad_()
    b16 = (torch.randn(n, r, device=device) / r**0.5).to(dtype).requires_grad_()
    a32 = a16.detach().float().requires_grad_()
    b32 = b16.detach().float().requires_grad_()

    def lora(x):
        return F.linear(F.linear(x, a16), b16) * scaling

    return {
        "ceiling": (lambda x: F.linear(x, w_bf16) + lora(x), (a16, b16)),
        "fastlora": (lambda x: fastlora_linear(x, nf4, None, a16, b16, scaling), (a16, b16)),
        "fastlora-fp32A": (lambda x: fastlora_linear(x, nf4, None, a32, b32, scaling), (a32, b32)),
        "fastlora-int8": (lambda x: fastlora_linear(x, int8, None, a16, b16, scaling), (a16, b16)),
        "bnb": (lambda x: bnb.matmul_4bit(x, q.t(), quant_state=state) + lora(x), (a16, b16)),
    }


def make_weights(k, n, device="cuda", dtype=torch.bfloat16):
    """(NF4 double-quantized ``Packed4bit``, ``Int8Rowwise``, bf16 dequantized W, bnb (packed, quant_state))."""
    import bitsandbytes.functional as bnbF

    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    q, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    nf4 = packed4bit_from_bnb(q, state)
    cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
    return nf4, Int8Rowwise(cb=cb, scb=scb), dequantize(nf4, dtype), (q, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2048, 8192], help="tokens per call (batch * seq)")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("This benchmark needs a CUDA GPU.")
    device, dtype, scaling = "cuda", torch.bfloat16, 2.0
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | r={args.r}")
    header = f"{'K->N':>12} {'M':>6} {'variant':>15} {'fwd ms':>8} {'fwd+bwd':>8} {'fwd x':>6} {'f+b x':>6} {'host':>6}"
    print(header + "\n" + "-" * len(header))
    failures = []
    for k, n in SHAPES:
        weights = make_weights(k, n, device, dtype)
        dq_ms = bench(lambda nf4=weights[0]: dequantize(nf4, dtype), None)
        dq_host = host_ms(lambda nf4=weights[0]: dequantize(nf4, dtype), [], iters=200)
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(m, n, device=device, dtype=dtype)
            results = {}
            for name, (forward, params) in make_variants(k, n, m, args.r, scaling, weights, device, dtype).items():
                try:
                    results[name] = time_variant(forward, x, params, grad)
                except Exception as err:  # keep the table going if one baseline is unavailable here
                    print(f"{k:>5}->{n:<6} {m:>6} {name:>15} failed: {type(err).__name__}: {err}")
            ceil_fwd, ceil_fb, _ = results["ceiling"]
            for name, (fwd, fb, host) in results.items():
                row = f"{k:>5}->{n:<6} {m:>6} {name:>15} {fwd:8.3f} {fb:8.3f} {fwd / ceil_fwd:6.2f} {fb / ceil_fb:6.2f}"
                row += f" {host:6.3f}"
                print(row)
                if name == "fastlora" and m == TARGET_M and fb / ceil_fb > TARGET_RATIO:
                    failures.append(f"{k}->{n} M={m}: fwd+bwd {fb / ceil_fb:.3f}x the ceiling")
        print(f"{k:>5}->{n:<6} {'':>6} {'dequant nf4':>15} {dq_ms:8.3f} (host {dq_host * 1e3:.1f} us per call)")
        del weights
        torch.cuda.empty_cache()
    print(f"\nTarget: fastlora fwd+bwd at M={TARGET_M} <= {TARGET_RATIO:.2f}x the bf16 ceiling per shape.")
    print("MISSED:\n  " + "\n  ".join(failures) if failures else "All shapes meet the target.")


if __name__ == "__main__":
    main()
