"""FSDP1 save check, run under ``torchrun`` (2 processes, gloo on CPU):

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.distributed.fsdp1_save_worker \
        --model M --out D [--scenarios bf16-st-a32-gc-mts]

Mirrors what the HF Trainer does under accelerate's FSDP1 plugin: ``prepare_for_fsdp(model, fsdp_version=1)``,
``FullyShardedDataParallel`` with PEFT's ``fsdp_auto_wrap_policy`` (each decoder layer, each trainable leaf a unit),
``use_orig_params=False`` and bf16 mixed precision; one training step; accelerate's full state dict
(``FULL_STATE_DICT``, ``rank0_only=True``); then ``save_pretrained(state_dict=...)`` on rank 0 only. The saved adapter
must hold every LoRA weight and the ``modules_to_save`` copy, equal to the gathered tensors.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

import torch

from tests.distributed import _common as C


def run_scenario(model_path: str, scenario: C.Scenario, device: torch.device, rank: int, world: int,
                 out_dir: Path) -> dict:
    from peft.utils.other import fsdp_auto_wrap_policy
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from peft_fastlora.distributed import prepare_for_fsdp

    C.set_kernel_path(scenario, device)
    model = C.build_model(model_path, scenario, device)
    prepare_for_fsdp(model, fsdp_version=1)
    dtype = scenario.dtype
    wrapped = FSDP(
        model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=fsdp_auto_wrap_policy(model),
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
        use_orig_params=False, device_id=device,
    )
    ids = C.local_rows(C.make_batches(model.config.vocab_size)[0], rank, world).to(device)
    wrapped(input_ids=ids, labels=ids).loss.backward()
    # accelerate 1.15 uses offload_to_cpu=True; on a CPU model that crashed torch 2.13 (SIGSEGV), and changes nothing.
    config = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, config):
        gathered = wrapped.state_dict()
    names = [n for n, _ in model.named_modules()]
    result = {"ok": True, "nested_wrapper_names": sum("._fsdp_wrapped_module." in n for n in names)}
    if rank == 0:  # Trainer._save returns early on the other ranks
        save_dir = out_dir / f"fsdp1-save-{scenario.name}"
        model.save_pretrained(save_dir, state_dict=gathered)
        saved = load_file(save_dir / "adapter_model.safetensors")
        expected = {k.replace(".default.", "."): v for k, v in gathered.items() if ".lora_" in k}
        head = "base_model.model.lm_head"
        expected[f"{head}.weight"] = gathered[f"{head}.modules_to_save.default.weight"]
        result["saved_keys"] = sorted(saved)
        result["missing"] = sorted(set(expected) - set(saved))
        result["extra"] = sorted(set(saved) - set(expected))
        result["equal"] = all(torch.equal(saved[k], expected[k].to(saved[k].dtype)) for k in set(saved) & set(expected))
        result["ok"] = bool(not result["missing"] and not result["extra"] and result["equal"] and len(expected) > 1)
    return result


def main() -> None:
    faulthandler.dump_traceback_later(150, exit=True)  # a rank-0-only collective in the save would hang
    C.worker_main("fsdp1-save", run_scenario, "bf16-st-a32-gc-mts")


if __name__ == "__main__":
    main()
