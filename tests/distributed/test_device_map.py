"""A 4-bit FastLoRA model split over 2 GPUs by ``device_map="auto"`` + ``max_memory`` (GPU only).

Every FastLoRA call must get its input, weight and adapters on the layer's own device, every Triton kernel must run
on that device (counted per device with the profiler while the current device is cuda:0), and logits, loss and
adapter gradients must equal those of the same model on one GPU.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

import peft_fastlora
from tests.utils import bnb_config, save_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

LAYERS = 4
# Deterministic kernels on two GPUs of the same model give the same bits; leave room for a different cuBLAS choice.
ATOL, RTOL = 1e-2, 1e-2


def _load(path, device_map, max_memory=None):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(compute_dtype=torch.bfloat16), dtype=torch.bfloat16,
        device_map=device_map, max_memory=max_memory,
    )
    torch.manual_seed(0)
    config = peft_fastlora.FastLoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)  # B != 0
    return get_peft_model(base, config)


def _split_model(path, footprint: int):
    """``device_map="auto"`` with a ``max_memory`` on cuda:0 that holds only part of the model."""
    tried = {}
    for fraction in (0.5, 0.35, 0.65, 0.25, 0.8):
        max_memory = {0: int(footprint * fraction), 1: "20GiB"}
        model = _load(path, "auto", max_memory)
        devices = set(model.base_model.model.hf_device_map.values())
        tried[fraction] = sorted(map(str, devices))
        if {0, 1} <= devices:
            return model, max_memory
        del model
    pytest.fail(f"device_map='auto' never split the model over 2 GPUs: {tried}")


def _record_calls(monkeypatch):
    calls = []
    original = peft_fastlora.ops.fastlora_linear

    def recording(x, weight, bias, lora_a, lora_b, scaling, lora_x=None):
        devices = {x.device, weight.device} | {t.device for t in (bias, lora_a, lora_b, lora_x) if t is not None}
        calls.append((str(weight.device), sorted(map(str, devices))))
        return original(x, weight, bias, lora_a, lora_b, scaling, lora_x)

    monkeypatch.setattr(peft_fastlora.ops, "fastlora_linear", recording)
    return calls


def _fastlora_kernel_names() -> set[str]:
    """Names of the Triton kernels in ``peft_fastlora/ops`` (``@triton.jit`` functions called ``_..._kernel``)."""
    ops_dir = Path(peft_fastlora.ops.__file__).parent
    return {m for f in ops_dir.rglob("*.py") for m in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)}


def _kernels_per_device(prof, names: set[str]) -> dict[int, int]:
    """How many FastLoRA Triton kernels ran on each CUDA device during ``prof``."""
    counts: dict[int, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and any(n in event.name for n in names):
            counts[event.device_index] = counts.get(event.device_index, 0) + 1
    return counts


def _forwards(model, ids):
    """No-grad logits for a prefill-sized input (dequant kernel + cuBLAS) and a decode-sized one (fused kernel)."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float().cpu(), model(input_ids=ids[:1, :4]).logits.float().cpu()


def _run(model, ids):
    """Logits and loss of one training step, plus the adapter gradients (fp32, CPU)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.float().cpu(), out.loss.float().cpu(), grads


def test_device_map_split_matches_single_gpu(tmp_path, monkeypatch):
    path = save_tiny_llama(tmp_path / "tiny", num_hidden_layers=LAYERS)
    single = _load(path, {"": 0})
    footprint = single.base_model.model.get_memory_footprint()
    ids = torch.randint(0, single.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    ref_logits, ref_loss, ref_grads = _run(single, ids)
    ref_prefill, ref_decode = _forwards(single, ids)
    del single
    torch.cuda.empty_cache()

    split, max_memory = _split_model(path, footprint)
    calls = _record_calls(monkeypatch)
    torch.cuda.set_device(0)  # a kernel launched on the current device instead of its tensors' would land on cuda:0
    logits, loss, grads = _run(split, ids)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill, decode = _forwards(split, ids)  # every FastLoRA layer launches the same kernels here
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    layers = {}
    for module in split.modules():
        if isinstance(module, peft_fastlora.FastLoraLayer):
            index = module.get_base_layer().weight.device.index
            layers[index] = layers.get(index, 0) + 1
    names = _fastlora_kernel_names()
    kernels = _kernels_per_device(prof, names)
    report = {
        "max_memory": {str(k): v for k, v in max_memory.items()},
        "device_map": {k: str(v) for k, v in split.base_model.model.hf_device_map.items()},
        "fastlora_layers_per_device": layers,
        "fastlora_kernel_names": sorted(names),
        "fastlora_kernels_per_device": kernels,
        "fastlora_calls_per_device": {d: sum(c[0] == d for c in calls) for d in ("cuda:0", "cuda:1")},
        "mixed_device_calls": [c for c in calls if len(c[1]) != 1],
        "logits_max_abs_diff": (logits - ref_logits).abs().max().item(),
        "prefill_max_abs_diff": (prefill - ref_prefill).abs().max().item(),
        "decode_max_abs_diff": (decode - ref_decode).abs().max().item(),
        "loss": [loss.item(), ref_loss.item()],
        "grad_max_abs_diff": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
    }
    if os.environ.get("FASTLORA_DIST_REPORT"):
        with open(os.environ["FASTLORA_DIST_REPORT"], "w") as f:
            json.dump(report, f, indent=1, default=str)

    assert set(layers) == {0, 1}, report
    assert not report["mixed_device_calls"], report
    assert all(report["fastlora_calls_per_device"].values()), report
    # Same kernels per layer in these forwards, so each device runs kernels in proportion to its layers.
    assert set(kernels) == {0, 1}, report
    assert kernels[0] * layers[1] == kernels[1] * layers[0], report
    for got, ref in ((logits, ref_logits), (prefill, ref_prefill), (decode, ref_decode), (loss, ref_loss)):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    assert sorted(grads) == sorted(ref_grads)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], atol=ATOL, rtol=RTOL, msg=key)
