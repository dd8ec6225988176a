"""LoRA's passes over activations in a training call, as the package runs them against what they replaced (r = 16).

    python benchmarks/bench_lowrank.py [--out DIR]

- The LoRA term added in place, ``out += scaling * a @ b.T``: cuBLAS' ``addmm_`` against the Triton pass
  (``ops/kernels/lowrank.py``), for the forward (``y += s xa @ B.T``, B an (N, r) matrix) and the input grad
  (``dx += t @ A``, A.T a strided view), at Llama-3-8B's output widths; a device-to-device copy of ``out`` is the
  bandwidth line. GB/s counts ``out`` read + written.
- The fused MLP down projection's backward past its matmuls, at Llama-3-8B's intermediate size: ``h = silu(g) * u``
  made again, ``dA = t.T @ h`` by cuBLAS and the SwiGLU backward (what ran before) against
  ``silu_mul_backward_lora`` (one pass: dA from gate and up, h never written). GB/s counts the fused pass's bytes
  (gate, up, dh read; d gate, d up written).
- The same backward with the fast path's pending terms (gate's, up's and d h's, ``ops/swiglu_lora.py``), and the
  gate and up B grads (``s dg.T @ xa``): two cuBLAS calls that read d gate and d up back, against the same sums made
  in the SwiGLU pass (``term_b_grads=True``, ``B_GRADS_IN_SWIGLU_PASS``). GB/s as above.
- The projection groups (``ops/lora_group.py``): forward and forward+backward of Llama-3-8B's q/k/v (4096 ->
  4096 / 1024 / 1024) and gate/up (4096 -> 14336 / 14336) nf4 projections as one ``lora_linear_group`` op against the
  separate ``fastlora_linear`` ops (autograd summing their input grads); no GB/s (the matmuls dominate).

Token counts of a batch-1 and a batch-4 step (2,048 / 8,192); times are medians of ``triton.testing.do_bench`` (L2
flushed per call). Writes lowrank.csv.

GPU:   python benchmarks/bench_lowrank.py --out benchmarks/results
CI:    python benchmarks/bench_lowrank.py --device cpu --tiny --out /tmp/x   (the Triton interpreter)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common as C
import torch

MS = [2048, 8192]
NS = [1024, 4096, 14336]
INTERMEDIATE = 14336
TINY = ([16, 40], [32, 72])
TINY_INTERMEDIATE = 96
RANK = 16
GROUPS = {"q/k/v": (4096, [4096, 1024, 1024]), "gate/up": (4096, [14336, 14336])}
TINY_GROUPS = {"q/k/v": (64, [64, 32, 32]), "gate/up": (64, [128, 128])}
COLUMNS = ["case", "M", "N", "r", "impl", "time_ms", "GBps", "pct_copy", "speedup_vs_cublas", "max_abs_diff"]


def cases(m: int, n: int, device: torch.device):
    """``(case, out, a, b)``: b is (N, r), a matrix for the forward and A.T (strided) for the input grad."""
    gen = torch.Generator(device=device).manual_seed(m * 7 + n)
    out = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
    a = torch.randn(m, RANK, device=device, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, RANK, device=device, generator=gen) / RANK**0.5).to(torch.bfloat16)
    at = (torch.randn(RANK, n, device=device, generator=gen) / n**0.5).to(torch.bfloat16).t()
    return [("forward y += s xa @ B.T", out, a, b, 2.0), ("input grad dx += t @ A", out, a, at, 1.0)]


def time_case(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, lowrank_add, device) -> dict:
    """Milliseconds per call of a copy of ``out``, cuBLAS' ``addmm_`` and the Triton pass (all into a scratch copy)."""
    work, spare = out.clone(), torch.empty_like(out)
    timed = {
        "copy": lambda: spare.copy_(work),
        "cublas addmm_": lambda: work.addmm_(a, b.t(), alpha=s),
        "triton": lambda: lowrank_add(work, a, b, s),
    }
    return {impl: C.bench_ms(fn, device) for impl, fn in timed.items()}


def time_down_backward(m: int, inter: int, swiglu, device) -> tuple[dict, float]:
    """Milliseconds of the down projection's SwiGLU backward with dA, made-h against fused, and the fused dA's max
    difference from an fp32 product with h."""
    gen = torch.Generator(device=device).manual_seed(m + inter)
    gate, up, dh = (torch.randn(m, inter, device=device, generator=gen).to(torch.bfloat16) for _ in range(3))
    t = torch.randn(m, RANK, device=device, generator=gen).to(torch.bfloat16)

    def made_h():
        h = swiglu.silu_mul(gate, up)
        da = torch.mm(t.t(), h)
        del h
        return (*swiglu.silu_mul_backward(dh.clone(), gate, up, grad_h_is_scratch=True), da)

    def fused():
        return swiglu.silu_mul_backward_lora(dh.clone(), gate, up, t, grad_h_is_scratch=True)

    exact = t.float().t() @ swiglu.silu_mul(gate, up).float()  # fp32 product with the h the forward wrote
    diff = (fused()[2] - exact).abs().max().item()
    clone = lambda: dh.clone()  # noqa: E731 (both cases clone dh, as scratch for d gate)
    times = {impl: C.bench_ms(fn, device) for impl, fn in (("clone", clone), ("h made", made_h), ("fused", fused))}
    return {k: v - times["clone"] for k, v in times.items() if k != "clone"}, diff


def time_term_b_grads(m: int, inter: int, swiglu, device) -> tuple[dict, float]:
    """Milliseconds of the SwiGLU backward with pending terms plus the gate and up B grads, by two cuBLAS calls
    after it and in its pass, and the largest difference between the two ways' B grads."""
    from peft_fastlora.ops.lora_linear import lora_b_grad

    gen = torch.Generator(device=device).manual_seed(3 * m + inter)
    gate, up, dh = (torch.randn(m, inter, device=device, generator=gen).to(torch.bfloat16) for _ in range(3))
    t, xa = (torch.randn(m, RANK * k, device=device, generator=gen).to(torch.bfloat16) for k in (1, 2))
    b_g, b_u, a_d = ((torch.randn(inter, RANK, device=device, generator=gen) / RANK**0.5).to(torch.bfloat16)
                     for _ in range(3))  # fmt: skip
    terms = dict(gate_term=(xa[:, :RANK], b_g, 2.0), up_term=(xa[:, RANK:], b_u, 2.0), grad_h_term=(t, a_d, 1.0))

    def separate():
        dg, du, da = swiglu.silu_mul_backward_lora(dh.clone(), gate, up, t, grad_h_is_scratch=True, **terms)
        return lora_b_grad(dg, xa[:, :RANK], b_g, 2.0), lora_b_grad(du, xa[:, RANK:], b_u, 2.0)

    def in_pass():
        *_, gb, ub = swiglu.silu_mul_backward_lora(dh.clone(), gate, up, t, grad_h_is_scratch=True, **terms,
                                                   term_b_grads=True)  # fmt: skip
        return (gb.t() * 2.0).to(torch.bfloat16), (ub.t() * 2.0).to(torch.bfloat16)

    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(separate(), in_pass()))
    clone = lambda: dh.clone()  # noqa: E731 (both cases clone dh, as scratch for d gate)
    times = {impl: C.bench_ms(fn, device) for impl, fn in (("clone", clone), ("cuBLAS after", separate),
                                                           ("in pass", in_pass))}  # fmt: skip
    return {k: v - times["clone"] for k, v in times.items() if k != "clone"}, diff


def time_group(m: int, k: int, outs: list[int], device) -> tuple[dict, float]:
    """Milliseconds of forward and forward+backward of nf4 projections of one input, grouped and separate, and the
    largest difference between their outputs and input grads."""
    from peft_fastlora.ops import LoraProjection, lora_linear_group
    from peft_fastlora.ops.lora_group import lora_linear_group_ref

    gen = torch.Generator(device=device).manual_seed(m + k + sum(outs))
    projections = []
    for n in outs:
        w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
        a = (torch.randn(RANK, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16).requires_grad_()
        b = (torch.randn(n, RANK, device=device, generator=gen) / RANK**0.5).to(torch.bfloat16).requires_grad_()
        projections.append(LoraProjection(C.quantize_nf4(w)[0], a, b, 2.0))
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    grads = [torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16) for n in outs]
    leaves = [x] + [t for p in projections for t in (p.lora_a, p.lora_b)]
    ops = {"separate": lora_linear_group_ref, "grouped": lora_linear_group}
    results = {}
    for impl, op in ops.items():
        ys = op(x, projections)
        results[impl] = [y.detach().float() for y in ys] + [torch.autograd.grad(ys, x, grads)[0].float()]
    diff = max((a - b).abs().max().item() for a, b in zip(results["grouped"], results["separate"]))
    times = {}
    for impl, op in ops.items():
        with torch.no_grad():
            times[f"{impl} fwd"] = C.bench_ms(lambda op=op: op(x, projections), device)
        times[f"{impl} fwd+bwd"] = C.bench_ms(lambda op=op: torch.autograd.grad(op(x, projections), leaves, grads),
                                              device)  # fmt: skip
    return times, diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke run)")
    args = p.parse_args(argv)
    device = C.pick_device(args.device)
    C.setup_run()
    env = C.env_info(device)
    C.print_header("LoRA term added in place: cuBLAS addmm_ vs the Triton pass", env)
    lowrank_add = C.internals().lowrank_add
    ms, ns = TINY if args.tiny else (MS, NS)
    log = C.CsvLog(Path(args.out) / "lowrank.csv", COLUMNS, env)
    rows = []
    for m in ms:
        for n in ns:
            for case, out, a, b, s in cases(m, n, device):
                nbytes = 2 * out.numel() * out.element_size()
                ref = out.clone().addmm_(a, b.t(), alpha=s)
                mine = lowrank_add(out.clone(), a, b, s)
                diff = (mine.float() - ref.float()).abs().max().item()
                times = time_case(out, a, b, s, lowrank_add, device)
                for impl, ms_ in times.items():
                    row = dict(case=case, M=m, N=n, r=RANK, impl=impl, time_ms=ms_, GBps=nbytes / ms_ / 1e6,
                               pct_copy=100 * times["copy"] / ms_,
                               speedup_vs_cublas=None if impl == "copy" else times["cublas addmm_"] / ms_,
                               max_abs_diff=diff if impl == "triton" else None)  # fmt: skip
                    rows.append(row)
                    log.append(row)
        inter = TINY_INTERMEDIATE if args.tiny else INTERMEDIATE
        times, diff = time_down_backward(m, inter, C.internals().swiglu, device)
        nbytes = 5 * m * inter * 2
        for impl, ms_ in times.items():
            row = dict(case="down dA + SwiGLU backward", M=m, N=inter, r=RANK, impl=impl, time_ms=ms_,
                       GBps=nbytes / ms_ / 1e6, speedup_vs_cublas=times["h made"] / ms_,
                       max_abs_diff=diff if impl == "fused" else None)  # fmt: skip
            rows.append(row)
            log.append(row)
        times, diff = time_term_b_grads(m, inter, C.internals().swiglu, device)
        for impl, ms_ in times.items():
            row = dict(case="SwiGLU backward with terms + gate/up dB", M=m, N=inter, r=RANK, impl=impl, time_ms=ms_,
                       GBps=nbytes / ms_ / 1e6, speedup_vs_cublas=times["cuBLAS after"] / ms_,
                       max_abs_diff=diff if impl == "in pass" else None)  # fmt: skip
            rows.append(row)
            log.append(row)
        for name, (k, outs) in (TINY_GROUPS if args.tiny else GROUPS).items():
            times, diff = time_group(m, k, outs, device)
            for impl, ms_ in times.items():
                mode = impl.split(" ")[1]
                row = dict(case=f"{name} projection group, {mode}", M=m, N=sum(outs), r=RANK, impl=impl.split(" ")[0],
                           time_ms=ms_, speedup_vs_cublas=times[f"separate {mode}"] / ms_,
                           max_abs_diff=diff if impl.startswith("grouped") else None)  # fmt: skip
                rows.append(row)
                log.append(row)
    C.print_table(rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
