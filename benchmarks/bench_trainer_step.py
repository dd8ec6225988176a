"""HF Trainer steps on the training-step benchmark model, eager against ``peft_fastlora.record_trainer_steps``.

One mode per process (``--mode eager`` or ``recorded``; without ``--mode`` both run, each in its own subprocess, one
after the other). The model is ``bench_train_step.py``'s (Llama-3-8B shape, 8 decoder layers, random weights, nf4,
FastLoRA r=16 on all linear layers) with the fast path (``enable_fast_path``; activation offload in the checkpointed
rows), trained by ``transformers.Trainer`` (bf16, AdamW, ``max_grad_norm=1.0``) on fixed-length random batches without
an attention mask. Step times are the wall time between consecutive ``on_step_end`` callbacks after ``--warmup``
optimizer steps (the recording happens in the first steps), median; peak memory is ``max_memory_allocated``.

    python benchmarks/bench_trainer_step.py --out DIR [--batches 1,4] [--ckpt off,on] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import _common as C
import bench_train_step as B
import torch

COLUMNS = ["mode", "optim", "batch", "seq", "ckpt", "steps", "median_step_ms", "tokens_per_s", "peak_GiB", "replayed",
           "eager", "recordings", "status", "error"]  # fmt: skip


def run_mode(args, mode: str, out: Path) -> None:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import peft_fastlora

    transformers.logging.set_verbosity_error()
    device = torch.device("cuda")
    config = B.model_config()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        model, _, _ = B.build_and_save(config, device, model_dir)
        del model
        torch.cuda.empty_cache()
    env = C.env_info(device)
    log = C.CsvLog(out / f"trainer_{mode}.csv", COLUMNS, env)
    rows = []
    for batch in args.batches:
        for ckpt in args.ckpt:
            row = dict(mode=mode, optim=args.optim, batch=batch, seq=args.seq, ckpt=ckpt, steps=args.steps,
                       status="ok", error="")  # fmt: skip
            try:
                row.update(_one(args, mode, batch, ckpt == "on", config, model_dir, device, Trainer, TrainerCallback,
                                TrainingArguments, peft_fastlora))  # fmt: skip
            except Exception as err:  # one failed row must not lose the others
                row.update(status="error", error=C.short_error(err))
            rows.append(row)
            log.rewrite(rows)
            print(row, flush=True)
            C.free_memory(device)


def _one(args, mode, batch, ckpt, config, model_dir, device, Trainer, TrainerCallback, TrainingArguments, fastlora):
    model = B.load_model(model_dir, "nf4", device)
    torch.manual_seed(0)
    model, _ = B.wrap(model, "fastlora-nf4", SimpleNamespace(lora_dropout=0.0, adapter_dtype="default"))
    fastlora.enable_fast_path(model, offload_activations=ckpt)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(3, config.vocab_size, (batch * args.steps, args.seq), generator=g)]  # fmt: skip

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    clock = Clock()
    targs = TrainingArguments(output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=batch,
                              max_steps=args.steps, learning_rate=1e-4, bf16=True, max_grad_norm=1.0,
                              gradient_checkpointing=ckpt, gradient_checkpointing_kwargs={"use_reentrant": False},
                              logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True,
                              dataloader_drop_last=True, seed=0, optim=args.optim)  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[clock])
    stats = fastlora.record_trainer_steps(trainer) if mode == "recorded" else None
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    gaps = [b - a for a, b in zip(clock.times[args.warmup :], clock.times[args.warmup + 1 :])]
    step = statistics.median(gaps)
    result = dict(median_step_ms=step * 1e3, tokens_per_s=batch * args.seq / step,
                  peak_GiB=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip
    if stats is not None:
        result.update(replayed=stats.replayed, eager=stats.eager, recordings=stats.recordings)
    del trainer, model
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/trainer"))
    p.add_argument("--mode", choices=["eager", "recorded"], help="one mode in this process (default: both, each in "
                   "its own subprocess)")  # fmt: skip
    p.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 4])
    p.add_argument("--ckpt", type=lambda v: v.split(","), default=["off", "on"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per row")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median (the recording is in them)")
    p.add_argument("--model-dir", default="/tmp/fastlora-bench-model")
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (adamw_torch_fused: one kernel)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_trainer_step.py needs a GPU (CUDA graphs); nothing to measure on this machine.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode:
        run_mode(args, args.mode, args.out)
        return 0
    for mode in ("eager", "recorded"):
        cmd = [sys.executable, __file__, "--mode", mode, *(argv if argv is not None else sys.argv[1:])]
        subprocess.run(cmd, check=False)
    rows = [r for mode in ("eager", "recorded") for r in C.read_csv(args.out / f"trainer_{mode}.csv")]
    C.print_table(rows, COLUMNS[:-2], "Trainer steps: eager against record_trainer_steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
