"""Fixtures of the ops tests: the one switch that runs the Triton path on CPU, and a clean dynamo cache."""

import os

import pytest
import torch

from peft_fastlora.ops import FORCE_TRITON_ENV


@pytest.fixture
def force_triton(monkeypatch):
    """Runs the Triton paths on CPU tensors (the interpreter), as the dispatcher does for CUDA tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py sets it when CUDA is absent)")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")


@pytest.fixture
def reference_path(monkeypatch):
    """CPU tensors take the pure-torch reference, whatever the environment says."""
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
