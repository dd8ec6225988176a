"""Test setup shared by every test module.

Without CUDA, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``); it must be set before anything
imports triton, which is why it lives here and not in a fixture. GPU tests (``@pytest.mark.gpu``) are skipped.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test draws fresh random inputs from a fixed, per-test seed so failures reproduce."""
    torch.manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A tiny random Llama saved once per test session (fp32 weights, 2 layers, hidden 64)."""
    from tests.utils import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_blocks_path(tmp_path_factory):
    """The tiny Llama with an MLP of whole 4-bit absmax blocks (intermediate 128): what the fused LoRA MLP takes
    (``tiny_llama_path``'s 96 is one and a half blocks, which keeps the down projection fusion only)."""
    from tests.utils import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-blocks"), intermediate_size=128)
