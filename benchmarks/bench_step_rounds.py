"""Training-step speed in interleaved rounds: providers resident in one process, timed a few steps each, in turn.

    python benchmarks/bench_step_rounds.py --out DIR [--providers bf16-lora,peft-bnb-nf4,fastlora-nf4] [--rounds 8]

Why: at batch 1 the step waits on the host (Python and kernel launches), and the host of a cloud GPU machine drifts
by tens of percent within a minute (an H100 host, one FastLoRA process: 57-61 ms steps, then 76-87 ms a few seconds
later, no GC or sync in between). Processes run one after the other, as ``bench_train_step.py`` runs them for their
peak memory, then compare hosts as much as code. Here every provider runs in every round, rounds rotate the order
(round i starts at provider i mod P), and each round's ratio to bf16 LoRA compares steps taken seconds apart: the
drift cancels out of it. Peak memory is not measured (models share the process); ``bench_train_step.py`` measures
it, each provider in its own process.

Same model and step as ``bench_train_step.py`` (Llama-3-8B-shaped, 8 layers, seq 2048, r=16 on every linear layer,
AdamW, bf16 autocast); providers: ``bf16-lora``, ``peft-bnb-nf4``, ``peft-bnb-nf4-dq``, ``peft-bnb-int8``,
``fastlora-nf4``, ``fastlora-nf4-dq``, ``fastlora-int8`` (the fast path and Unsloth patch modules process-wide: they
run in ``bench_train_step.py``). Writes ``step_rounds.csv``: per (batch, ckpt, provider) the median step ms and
tokens/s over rounds, the per-round tokens/s, and the same-round ratio to bf16 LoRA (median, min, max).

CI:    python benchmarks/bench_step_rounds.py --device cpu --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import _common as C
import bench_train_step as B
import torch

PROVIDERS = ("bf16-lora", "peft-bnb-nf4", "peft-bnb-nf4-dq", "peft-bnb-int8", "fastlora-nf4", "fastlora-nf4-dq",
             "fastlora-int8")  # fmt: skip
COLUMNS = ["batch", "ckpt", "provider", "rounds", "steps_per_round", "median_step_ms", "tokens_per_s",
           "round_tokens_per_s", "ratio_to_bf16_round_median", "ratio_to_bf16_round_min", "ratio_to_bf16_round_max"]


def round_ms(model, optimizer, ids: torch.Tensor, device: torch.device, warmup: int, steps: int) -> float:
    """Median ms of ``steps`` steps after ``warmup`` untimed ones (the first step after another provider's is slower:
    its memory comes back from the allocator's cache in other block sizes)."""
    step = functools.partial(B.train_step, model, optimizer, ids, device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        C.sync(device)
        start = time.perf_counter()
        step()
        C.sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_rows(models: dict, batch: int, ckpt: bool, args, device: torch.device, vocab: int) -> list[dict]:
    """Every provider in every round (rotating order); one row per provider."""
    ids = torch.randint(3, vocab, (batch, args.seq), device=device)
    optimizers = {}
    for provider, model in models.items():
        B.set_checkpointing(model, ckpt)
        model.train()
        optimizers[provider] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ms: dict[str, list[float]] = {p: [] for p in models}
    for i in range(args.rounds):
        for provider in B.round_order(list(models), i):
            ms[provider].append(round_ms(models[provider], optimizers[provider], ids, device, args.warmup_steps,
                                         args.steps))  # fmt: skip
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    tokens = batch * args.seq
    base = [tokens / m * 1e3 for m in ms["bf16-lora"]] if "bf16-lora" in ms else []
    rows = []
    for provider, values in ms.items():
        rates = [tokens / m * 1e3 for m in values]
        ratios = B.same_round_ratios(rates, base) if base else []
        median_ms = statistics.median(values)
        rows.append(dict(batch=batch, ckpt="on" if ckpt else "off", provider=provider, rounds=len(values),
                         steps_per_round=args.steps, median_step_ms=median_ms, tokens_per_s=tokens / median_ms * 1e3,
                         round_tokens_per_s=";".join(f"{r:.6g}" for r in rates),
                         ratio_to_bf16_round_median=statistics.median(ratios) if ratios else None,
                         ratio_to_bf16_round_min=min(ratios) if ratios else None,
                         ratio_to_bf16_round_max=max(ratios) if ratios else None))  # fmt: skip
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny 2-layer model, seq 32, 2 rounds: CI smoke run")
    p.add_argument("--providers", default="bf16-lora,peft-bnb-nf4,fastlora-nf4",
                   help=f"comma-separated subset of {list(PROVIDERS)}; bf16-lora gives the ratios")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1: the host-bound rows)")
    p.add_argument("--ckpt", choices=["both", "off", "on"], default="both", help="gradient checkpointing")
    p.add_argument("--arch", choices=sorted(B.ARCH_SHAPES), default="llama")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 8; tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per provider and round (default 4; tiny 1)")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps per provider and round")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 32)")
    p.add_argument("--model-dir", type=Path, default=None, help="a saved benchmark model to reuse (else built)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.rounds = args.rounds or (2 if args.tiny else 8)
    args.steps = args.steps or (1 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    providers = C.parse_csv_arg(args.providers)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; choose from {list(PROVIDERS)}")
    device = C.pick_device(args.device)
    env = C.env_info(device)
    C.print_header("bench_step_rounds: training-step speed in interleaved rounds (one process)", env)
    config = B.model_config(args.tiny, args.arch)
    wrap_args = types.SimpleNamespace(lora_dropout=0.0, adapter_dtype="default", recompute_last_block=False)
    with tempfile.TemporaryDirectory(prefix="fastlora-rounds-") as tmp:
        path = args.model_dir or Path(tmp)
        if not (path / "config.json").exists():
            model, _, _ = B.build_and_save(config, device, path)
            del model
            C.free_memory(device)
        models = {p: B.wrap(B.load_model(path, B.PROVIDERS[p][0], device), p, wrap_args)[0] for p in providers}
    log = C.CsvLog(args.out / "step_rounds.csv", COLUMNS, env)
    rows = []
    for batch in (int(b) for b in C.parse_csv_arg(args.batches)):
        for ckpt in {"both": (False, True), "off": (False,), "on": (True,)}[args.ckpt]:
            for row in run_rows(models, batch, ckpt, args, device, config.vocab_size):
                log.append(row)
                rows.append(row)
            print(C.format_table(rows[-len(models):], COLUMNS[:3] + COLUMNS[5:7] + COLUMNS[8:]), flush=True)
    log.rewrite(rows)
    print(f"bench_step_rounds done; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
