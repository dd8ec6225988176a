"""HF Trainer check, launched by accelerate:

    accelerate launch --config_file tests/distributed/accelerate_ddp.yaml -m tests.distributed.trainer_worker \
        --model M --out D --scenario fp32-gc-mts [--cpu]

Trains ``STEPS`` SGD steps with ``Trainer`` (``ddp_find_unused_parameters=False``, sequential sampling, constant LR,
no clipping), saves the adapter with ``trainer.save_model``, and on rank 0 compares the saved adapter with the same
training done in one process on the whole global batch (``_common.run_reference``). With an FSDP accelerate config,
``peft_fastlora.distributed.prepare_for_fsdp`` is applied first, for accelerate's ``FSDP_VERSION`` (FSDP1 scenarios
need ``st``; FSDP2 takes any storage). The packed 4-bit bytes each layer sees in its first forward must be the bytes it
had before training (``packed_bytes``). Writes ``trainer-<tag>.json`` to D (tag: ``--tag``, default the scenario).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
from pathlib import Path

import torch

if not torch.cuda.is_available() or "--cpu" in os.sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from tests.distributed import _common as C  # noqa: E402


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(args, scenario: C.Scenario) -> dict:
    from transformers import Trainer, TrainingArguments

    class SequentialTrainer(Trainer):
        # Sequential sampling + accelerate's batch sharding: step s, rank r gets rows r*G/W.. of global batch s.
        # (An override rather than `train_sampling_strategy`, which older transformers 5.x may not have.)
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    from peft_fastlora.bnb import FastLoraLinear4bit
    from peft_fastlora.distributed import fsdp_launched, prepare_for_fsdp, resolve_fsdp_version
    from tests.distributed.fsdp_worker import watch_packed_bytes

    if args.cpu:
        os.environ["FASTLORA_DIST_CPU"] = "1"
    device = C.worker_device()
    C.set_kernel_path(scenario, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    fsdp = fsdp_launched()
    ref = None
    if rank == 0:
        # The single-process reference runs first, before any collective: run after FSDP1 training, rank 0's model
        # load hung in a device copy once rank 1 had left (2x H200), which is about the harness, not the product.
        ref = C.run_reference(args.model, scenario, device, prepare=prepare_for_fsdp if fsdp else None)
        del ref["model"]
    model = C.build_model(args.model, scenario, device)
    if fsdp:
        prepare_for_fsdp(model)
    layers = [m for m in model.modules() if isinstance(m, FastLoraLinear4bit)]
    packed_dtypes = sorted({str(m.get_base_layer().weight.dtype) for m in layers})  # FSDP2: uint8, FSDP1: storage
    packed = watch_packed_bytes(model)
    batches = C.make_batches(model.config.vocab_size)
    dataset = _Rows(batches.reshape(-1, C.SEQ_LEN))
    training_args = TrainingArguments(
        output_dir=str(args.out / f"trainer-{args.tag}-ckpt"),
        per_device_train_batch_size=C.GLOBAL_BATCH // world,
        max_steps=C.STEPS,
        learning_rate=C.LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=args.cpu,
        gradient_checkpointing=scenario.grad_ckpt is not None,
        gradient_checkpointing_kwargs={"use_reentrant": scenario.grad_ckpt == "reentrant"},
        ddp_find_unused_parameters=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=C.SEED,
    )
    trainer = SequentialTrainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    save_dir = args.out / f"trainer-{args.tag}"
    trainer.save_model(str(save_dir))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"ok": True, "world_size": world, "device": str(device), "fsdp": fsdp,
              "fsdp_version": resolve_fsdp_version() if fsdp else None, "packed_dtypes": packed_dtypes,
              "packed_bytes": packed, "distributed_type": str(trainer.accelerator.distributed_type), "losses": losses}
    if rank == 0:
        from safetensors.torch import load_file

        saved = {k: v.float() for k, v in load_file(save_dir / "adapter_model.safetensors").items()}
        result["reference_losses"] = ref["losses"]
        result["comparison"] = C.compare(saved, ref["trained"], scenario.tolerance)
        result["update_size"] = C.update_size(ref["trained"], ref["initial"])
        distributed = "NO" not in result["distributed_type"] and (not fsdp or "FSDP" in result["distributed_type"])
        result["ok"] = bool(
            result["comparison"]["ok"] and world > 1 and distributed
            and packed["layers"] > 0 and packed["changed_bytes"] == 0
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenario", default="fp32-gc-mts")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even where CUDA is available")
    args = parser.parse_args()
    args.tag = args.tag or args.scenario
    # A step killed by its time limit (the launcher forwards SIGTERM) prints where every rank was stuck; the GPU run's
    # FSDP1 step timed out after training with no traceback at all.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(args, C.Scenario.parse(args.scenario))
    except Exception as err:
        result = C.error_result(err)
        print(f"[rank {rank}] trainer scenario {args.scenario} failed:\n{result['traceback']}", flush=True)
    if rank == 0 or not result["ok"]:
        C.write_result(args.out, "trainer" if rank == 0 else f"trainer-rank{rank}", args.tag, result)
    # Left to interpreter exit, the process group's threads can be torn down mid-flight and abort the worker
    # ("terminate called without an active exception", SIGABRT) after its result is written.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
