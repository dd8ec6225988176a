"""Fixtures of the safety tests: tiny checkpoints (saved once per session) and the device/kernel-path matrix."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.utils import TINY_LLAMA, save_tiny_llama

from .helpers import BNB_CPU_SAFE_INTERMEDIATE

# Where a test runs: the CPU reference path, the Triton path under the interpreter (the CUDA code path, slowly), or
# a real GPU. `device_path` yields the torch device for the model.
CPU = "cpu"
CPU_TRITON = "cpu-triton"
CUDA = "cuda"
DEVICE_PATHS = [CPU, CPU_TRITON, pytest.param(CUDA, marks=pytest.mark.gpu)]
CPU_AND_CUDA = [CPU, pytest.param(CUDA, marks=pytest.mark.gpu)]


def use_device_path(param: str, monkeypatch) -> str:
    """Sets up ``param`` (one of DEVICE_PATHS) and returns the torch device to put the model on."""
    if param == CPU_TRITON:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it without CUDA)")
        monkeypatch.setenv("PEFT_FASTLORA_FORCE_TRITON", "1")
        return "cpu"
    monkeypatch.delenv("PEFT_FASTLORA_FORCE_TRITON", raising=False)
    if param == CUDA and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return param


@pytest.fixture(params=DEVICE_PATHS)
def device_path(request, monkeypatch) -> str:
    return use_device_path(request.param, monkeypatch)


@pytest.fixture(params=CPU_AND_CUDA)
def device(request, monkeypatch) -> str:
    return use_device_path(request.param, monkeypatch)


@pytest.fixture(scope="session")
def parity_llama_path(tmp_path_factory):
    """The tiny Llama with intermediate_size=128: stock bitsandbytes on CPU dequantizes every layer of it correctly."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), intermediate_size=BNB_CPU_SAFE_INTERMEDIATE)


# Scale of the gate/up projections of the overflow model: with hidden states of RMS 1 after the RMSNorm, gate and up
# reach a few hundred, and silu(gate) * up exceeds fp16's 65504 for some tokens (as in Gemma-style MLPs).
OVERFLOW_SCALE = 1000.0


@pytest.fixture(scope="session")
def overflow_llama_path(tmp_path_factory):
    """A tiny Llama whose MLP product ``silu(gate) * up`` overflows fp16 (but not bf16/fp32)."""
    path = tmp_path_factory.mktemp("tiny-llama-overflow")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(OVERFLOW_SCALE)
            layer.mlp.up_proj.weight.mul_(OVERFLOW_SCALE)
    model.save_pretrained(path)
    return path
