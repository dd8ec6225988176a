"""What the usual QLoRA recipe costs: ``prepare_model_for_kbit_training`` (it upcasts norms and embeddings to fp32, so
fp32 activations reach the 4-bit layers, which then dequantize and multiply in fp32) with and without bf16 autocast.

Llama-3-8B-shaped model (8 decoder layers), FastLoRA nf4 (bf16 compute), r=16 on all linear layers, AdamW, one
process, the cases run one after the other on the same model file; gradient checkpointing on (the recipe's default).

GPU:  python benchmarks/bench_kbit_recipe.py --out benchmarks/results/kbit
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _common as C
import bench_train_step as B
import torch

CASES = {  # name -> (prepare_model_for_kbit_training, autocast)
    "bf16 model, autocast": (False, True),
    "prepare_model_for_kbit_training, autocast": (True, True),
    "prepare_model_for_kbit_training, no autocast": (True, False),
}
COLUMNS = ["case", "batch", "seq", "median_step_ms", "tokens_per_s", "ratio_to_first", "peak_GiB", "loss", "status",
           "error"]  # fmt: skip


def run_case(model_dir: Path, prepare: bool, autocast: bool, args, device, vocab: int) -> dict:
    from peft import get_peft_model, prepare_model_for_kbit_training

    import peft_fastlora

    model = B.load_model(model_dir, "nf4", device)
    if prepare:
        model = prepare_model_for_kbit_training(model)  # also enables (reentrant) gradient checkpointing
    else:
        model.gradient_checkpointing_enable()
    model = get_peft_model(model, peft_fastlora.FastLoraConfig(r=B.RANK, lora_alpha=2 * B.RANK,
                                                               target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, vocab, (args.batch, args.seq), device=device)
    C.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for i in range(args.warmup_steps + args.steps):
        C.sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        C.sync(device)
        if i >= args.warmup_steps:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(median_step_ms=step * 1e3, tokens_per_s=args.batch * args.seq / step, peak_GiB=peak,
                loss=float(loss), status="ok")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kbit"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model, seq 32: smoke run")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 32)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    args.seq = args.seq or (32 if args.tiny else 2048)
    import transformers

    transformers.logging.set_verbosity_error()
    device = C.pick_device(args.device)
    env = C.env_info(device)
    env["run"] = "bench_kbit_recipe " + " ".join(sys.argv[1:] if argv is None else argv)
    log = C.CsvLog(args.out / "kbit_recipe.csv", COLUMNS, env)
    config = B.model_config(args.tiny)
    rows = []
    with B.saved_random_model(config, device, "fastlora-kbit-model-") as model_dir:
        for name, (prepare, autocast) in CASES.items():
            row = dict(case=name, batch=args.batch, seq=args.seq)
            try:
                row.update(run_case(model_dir, prepare, autocast, args, device, config.vocab_size))
            except Exception as err:
                row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
            C.free_memory(device)
            rows.append(row)
            print(f"  {name}: {C.fmt(row.get('tokens_per_s'), 4)} tok/s, {C.fmt(row.get('peak_GiB'))} GiB "
                  f"{row['status']} {row.get('error') or ''}", flush=True)
    first = rows[0].get("tokens_per_s")
    for row in rows:
        row["ratio_to_first"] = C.ratio(row.get("tokens_per_s"), first)
    log.rewrite(rows)
    C.print_table(rows, COLUMNS, "== prepare_model_for_kbit_training, with and without autocast ==")
    return 0


if __name__ == "__main__":
    sys.exit(main())
