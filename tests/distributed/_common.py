"""Shared by the distributed workers (run under ``torchrun`` / ``accelerate launch``) and their tests.

A *scenario* is a name made of dash-separated tokens, e.g. ``"fp32-gc-mts"``:

- ``fp32`` / ``bf16`` / ``fp16``: model dtype and ``bnb_4bit_compute_dtype`` (default ``fp32``);
- ``ref``: keep the pure-torch reference path on CPU (otherwise CPU runs set ``PEFT_FASTLORA_FORCE_TRITON=1``, i.e.
  the ``LoraLinearFunction`` autograd path that CUDA uses, with Triton interpreted);
- ``gc`` / ``gcr``: gradient checkpointing, non-reentrant / reentrant;
- ``mts``: ``modules_to_save=["lm_head"]``;
- ``st``: ``bnb_4bit_quant_storage`` = model dtype (default uint8);
- ``a32``: ``adapter_dtype="fp32"`` (default ``"fp32-if-fp16"``);
- ``mp``: FSDP mixed precision with ``param_dtype`` = ``reduce_dtype`` = the model dtype;
- ``leaf``: FSDP2 also shards every ``lora_A`` / ``lora_B`` module as a unit of its own, like PEFT's
  ``fsdp_auto_wrap_policy`` does (the HF Trainer installs that policy for PEFT models under FSDP1);
- ``nan``: FSDP2's float copies rewrite every 16-bit word that reads as a NaN to the canonical NaN, as CUDA's do
  (a CPU simulation, see ``fsdp_worker.cuda_nan_rewrite``);
- ``v1``: ``prepare_for_fsdp(fsdp_version=1)`` (FSDP1's rule: packed weights stay floats) before ``fully_shard``,
  FSDP2 without the uint8 view: a control whose packed bytes must change under ``nan`` or on CUDA.

Every run trains ``STEPS`` SGD steps on the same global batches; rank ``r`` of ``W`` takes rows
``[r * G / W, (r + 1) * G / W)`` of each global batch, so DDP/FSDP (which average gradients) and one process on the
whole batch compute the same update. All sequences have the same length, so the mean of the per-rank mean losses is
the global mean loss.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

STEPS = 3
GLOBAL_BATCH = 4
SEQ_LEN = 16
LR = 0.5
SEED = 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# |got - ref| <= atol + rtol * |ref| for every adapter element after STEPS steps. fp32: reduction-order noise only.
# bf16/fp16: a few units in the last place of 16-bit weights: per-rank batches change GEMM shapes, hence summation
# order, hence the rounding of 16-bit activations, gradients and weight updates (bf16 ulp at 0.2 is 1e-3).
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (2e-3, 2e-2), "fp16": (5e-4, 1e-2)}
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Scenario:
    name: str
    dtype_name: str = "fp32"
    ref_path: bool = False
    grad_ckpt: Optional[str] = None  # None, "non-reentrant", "reentrant"
    modules_to_save: bool = False
    float_storage: bool = False
    adapter_dtype: str = "fp32-if-fp16"
    mixed_precision: bool = False
    adapter_units: bool = False
    nan_rewrite: bool = False
    fsdp1_rule: bool = False

    @classmethod
    def parse(cls, name: str) -> Scenario:
        tokens = name.split("-")
        known = set(DTYPES) | {"ref", "gc", "gcr", "mts", "st", "a32", "mp", "leaf", "nan", "v1"}
        unknown = [t for t in tokens if t not in known]
        if unknown:
            raise ValueError(f"unknown scenario tokens {unknown} in {name!r}; known: {sorted(known)}")
        return cls(
            name=name,
            dtype_name=next((t for t in tokens if t in DTYPES), "fp32"),
            ref_path="ref" in tokens,
            grad_ckpt="reentrant" if "gcr" in tokens else "non-reentrant" if "gc" in tokens else None,
            modules_to_save="mts" in tokens,
            float_storage="st" in tokens,
            adapter_dtype="fp32" if "a32" in tokens else "fp32-if-fp16",
            mixed_precision="mp" in tokens,
            adapter_units="leaf" in tokens,
            nan_rewrite="nan" in tokens,
            fsdp1_rule="v1" in tokens,
        )

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def tolerance(self) -> tuple[float, float]:
        return TOLERANCES[self.dtype_name]


def set_kernel_path(scenario: Scenario, device: torch.device) -> None:
    """On CPU, route FastLoRA through the autograd Function (Triton interpreted) unless the scenario says ``ref``."""
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["PEFT_FASTLORA_FORCE_TRITON"] = "0" if scenario.ref_path else "1"


def load_base(model_path: str, scenario: Scenario, device: torch.device):
    from tests.utils import load_quantized

    storage = scenario.dtype if scenario.float_storage else torch.uint8
    return load_quantized(model_path, dtype=scenario.dtype, device=device, compute_dtype=scenario.dtype,
                          quant_storage=storage)


def build_model(model_path: str, scenario: Scenario, device: torch.device):
    """The FastLoRA PEFT model of ``scenario``, with the same adapter initialization on every process."""
    from peft import get_peft_model

    from tests.utils import fast_config

    base = load_base(model_path, scenario, device)
    torch.manual_seed(SEED)
    config = fast_config(  # r=8, lora_alpha=16, every linear layer
        lora_dropout=0.0,
        adapter_dtype=scenario.adapter_dtype,
        modules_to_save=["lm_head"] if scenario.modules_to_save else None,
    )
    model = get_peft_model(base, config)
    if scenario.grad_ckpt is not None:
        reentrant = scenario.grad_ckpt == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    return model


def make_batches(vocab_size: int, steps: int = STEPS) -> torch.Tensor:
    """``(steps, GLOBAL_BATCH, SEQ_LEN)`` token ids, the same in every process."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, vocab_size, (steps, GLOBAL_BATCH, SEQ_LEN), generator=generator)


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def train(model, batches: torch.Tensor, rank: int, world: int, device: torch.device) -> dict:
    """``STEPS`` SGD steps; returns the losses and the trainable parameters that got no gradient on step 1."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    model.train()
    losses, no_grad = [], []
    names = {id(p): n for n, p in model.named_parameters()}
    for step, batch in enumerate(batches):
        ids = local_rows(batch, rank, world).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            no_grad = [names[id(p)] for p in params if p.grad is None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        if world > 1:  # report the global mean loss, comparable with the single-process run
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return {"losses": losses, "no_grad_params": no_grad}


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict (as saved), fp32 on CPU; DTensors gathered (a collective under FSDP)."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    from peft_fastlora.distributed import unwrap

    state = get_peft_model_state_dict(unwrap(model))
    out = {}
    for key, value in sorted(state.items()):
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().float().cpu().clone()  # a copy even when already fp32 on CPU
    return out


def compare(got: dict, ref: dict, tolerance: tuple[float, float]) -> dict:
    """Elementwise ``|got - ref| <= atol + rtol * |ref|`` over all adapter tensors; JSON-ready summary."""
    atol, rtol = tolerance
    if sorted(got) != sorted(ref):
        return {"ok": False, "error": f"key mismatch: {sorted(set(got) ^ set(ref))[:5]}"}
    worst, worst_key, max_abs = -1.0, None, 0.0
    for key in ref:
        diff = (got[key] - ref[key]).abs()
        excess = (diff - (atol + rtol * ref[key].abs())).max().item()
        max_abs = max(max_abs, diff.max().item())
        if excess > worst:
            worst, worst_key = excess, key
    return {"ok": worst <= 0.0, "max_abs_diff": max_abs, "worst_key": worst_key, "atol": atol, "rtol": rtol}


def update_size(trained: dict, initial: dict) -> float:
    """Largest change of any adapter element during training: shows the comparison is not vacuous."""
    return max((trained[k] - initial[k]).abs().max().item() for k in trained)


def meaningful(result: dict, tolerance: tuple[float, float]) -> bool:
    """Training moved the adapters far more than both the tolerance and the observed distributed/single difference."""
    return result["update_size"] > max(10 * tolerance[0], 20 * result["comparison"]["max_abs_diff"])


def run_reference(model_path: str, scenario: Scenario, device: torch.device, prepare=None) -> dict:
    """Single-process run on the whole global batch: initial and trained adapter tensors, losses."""
    model = build_model(model_path, scenario, device)
    if prepare is not None:
        prepare(model)
    initial = adapter_tensors(model)
    stats = train(model, make_batches(model.config.vocab_size), 0, 1, device)
    return {"initial": initial, "trained": adapter_tensors(model), "model": model, **stats}


def write_result(out_dir: Path, kind: str, scenario: str, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{kind}-{scenario}.json").write_text(json.dumps(result, indent=1, default=str))


def error_result(err: BaseException) -> dict:
    return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def read_results(out_dir: Path, kind: str) -> dict[str, dict]:
    return {p.stem.removeprefix(kind + "-"): json.loads(p.read_text()) for p in out_dir.glob(f"{kind}-*.json")}


def off_device_tensors(model, device: torch.device) -> list[str]:
    """Parameters and buffers not on ``device``: DDP broadcasts them all at wrap time, and NCCL has no CPU backend
    (``RuntimeError: No backend type associated with device type cpu``, seen on the GPUs before the overflow counter
    was created on the layer's device)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [f"{n} ({t.device})" for n, t in named if t.device != device]


def worker_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is usable and not disabled with ``FASTLORA_DIST_CPU=1``, else CPU."""
    if torch.cuda.is_available() and os.environ.get("FASTLORA_DIST_CPU", "0") != "1":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def worker_main(kind: str, run_scenario, default_scenarios: str) -> None:
    """The torchrun entry point shared by the workers: runs each ``--scenarios`` entry with ``run_scenario(model_dir,
    scenario, device, rank, world, out_dir)`` and writes rank 0's results (and any failing rank's) as ``kind``."""
    import argparse
    from datetime import timedelta

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scenarios", default=default_scenarios)
    args = parser.parse_args()

    device = worker_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.scenarios.split(","):
        scenario = Scenario.parse(name)
        try:
            result = run_scenario(args.model, scenario, device, rank, world, args.out)
        except Exception as err:  # record and go on: the other scenarios still tell something
            result = error_result(err)
            print(f"[rank {rank}] scenario {name} failed:\n{result['traceback']}", flush=True)
        if rank == 0 or not result["ok"]:
            write_result(args.out, kind if rank == 0 else f"{kind}-rank{rank}", name, result)
        dist.barrier()
    dist.destroy_process_group()
