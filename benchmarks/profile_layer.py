"""Profiles one FastLoRA training step (fwd+bwd) at one shape next to the bf16 ceiling; prints the top CUDA kernels.

Usage (CUDA): ``python benchmarks/profile_layer.py --k 4096 --n 4096 --m 2048``
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from peft_fastlora.bnb_weights import packed4bit_from_bnb
from peft_fastlora.ops import dequantize, fastlora_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--m", type=int, default=2048)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import bitsandbytes.functional as bnbF

    k, n, m, r = args.k, args.n, args.m, args.r
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    q, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    nf4 = packed4bit_from_bnb(q, state)
    w16 = dequantize(nf4, torch.bfloat16)
    a = (torch.randn(r, k, device="cuda") / k**0.5).bfloat16().requires_grad_()
    b = (torch.randn(n, r, device="cuda") / r**0.5).bfloat16().requires_grad_()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    variants = {
        "ceiling": lambda: (F.linear(x, w16) + F.linear(F.linear(x, a), b) * 2.0).backward(g),
        "fastlora": lambda: fastlora_linear(x, nf4, None, a, b, 2.0).backward(g),
    }
    for name, step in variants.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        print(f"== {name}  K={k} N={n} M={m} r={r}, {args.steps} steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
