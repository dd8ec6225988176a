"""DDP check, launched by ``torchrun --nproc-per-node 2 -m tests.distributed.ddp_worker --model M --out D``.

For each scenario (see ``_common``): wrap the FastLoRA model in
``DistributedDataParallel(find_unused_parameters=False)`` (gloo on CPU, nccl on CUDA), train ``STEPS`` steps on this
rank's share of each global batch, then on rank 0 train the same model in one process on the whole global batch and
compare the adapters. Writes ``ddp-<scenario>.json`` to D.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from tests.distributed import _common as C  # noqa: E402

DEFAULT_SCENARIOS = "fp32-ref,fp32,fp32-gc,fp32-mts"


# Single-process results by everything that changes the math (gradient checkpointing recomputes the same values).
_REFERENCES: dict[tuple, dict] = {}


def reference(model_path: str, scenario: C.Scenario, device: torch.device) -> dict:
    key = (scenario.dtype_name, scenario.ref_path, scenario.modules_to_save, scenario.float_storage,
           scenario.adapter_dtype)
    if key not in _REFERENCES:
        ref = C.run_reference(model_path, scenario, device)
        ref.pop("model")
        _REFERENCES[key] = {**ref, "scenario": scenario.name}
    return _REFERENCES[key]


def run_scenario(model_path: str, scenario: C.Scenario, device: torch.device, rank: int, world: int, out: Path):
    from safetensors.torch import load_file

    from peft_fastlora.distributed import save_adapter

    C.set_kernel_path(scenario, device)
    model = C.build_model(model_path, scenario, device)
    stray = C.off_device_tensors(model, device)
    if stray:
        raise RuntimeError(f"{len(stray)} parameters/buffers are not on {device}; DDP cannot broadcast: {stray[:5]}")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=False)
    stats = C.train(ddp, C.make_batches(model.config.vocab_size), rank, world, device)
    mine = C.adapter_tensors(model)
    save_dir = out / f"ddp-{scenario.name}"
    save_adapter(ddp, save_dir)  # through the DDP wrapper; only rank 0 writes
    replicas = [None] * world
    dist.all_gather_object(replicas, mine)
    result = {"ok": True, "world_size": world, "device": str(device), **stats}
    if rank == 0:
        saved = load_file(save_dir / "adapter_model.safetensors")
        result["save_matches_model"] = sorted(saved) == sorted(mine) and all(
            torch.equal(saved[k].float(), mine[k]) for k in mine
        )
        result["replicas_identical"] = all(
            torch.equal(r[k], mine[k]) for r in replicas for k in mine
        )
        ref = reference(model_path, scenario, device)
        result["reference_run"] = ref["scenario"]
        result["reference_losses"] = ref["losses"]
        result["comparison"] = C.compare(mine, ref["trained"], scenario.tolerance)
        result["update_size"] = C.update_size(ref["trained"], ref["initial"])
        result["ok"] = bool(
            result["comparison"]["ok"] and result["replicas_identical"] and result["save_matches_model"]
            and not stats["no_grad_params"]
        )
    return result


def main() -> None:
    C.worker_main("ddp", run_scenario, DEFAULT_SCENARIOS)

if __name__ == "__main__":
    main()
