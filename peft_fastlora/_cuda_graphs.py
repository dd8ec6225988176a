"""What the CUDA-graph recorders (graphed generation, the graphed training step) share: when a recording is stale,
and how one is made."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def model_fingerprint(model: nn.Module) -> int:
    """Changes with what a recorded graph has baked in: the address of every parameter and buffer (replaced by a
    merge or an adapter load; an optimizer step updates them in place and keeps them), each adapter layer's active
    adapters, disabled and merged flags, and train/eval mode."""
    state: list = [model.training]
    state += [t.data_ptr() for t in model.parameters()]
    state += [t.data_ptr() for t in model.buffers()]
    for module in model.modules():
        active = getattr(module, "active_adapters", None)
        if active is not None and not callable(active):
            state.append((tuple(active), getattr(module, "disable_adapters", False), getattr(module, "merged", False)))
    return hash(tuple(state))


def warm_up(function: Callable[[], None]) -> torch.cuda.Stream:
    """Runs ``function`` (real work: Triton compiles, cuBLAS sets up the stream's workspace, Inductor compiles) on a
    new side stream and makes the current stream wait for it; returns that stream, to record on."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    return stream


def record(function: Callable[[], None], stream: torch.cuda.Stream, pool=None) -> torch.cuda.CUDAGraph:
    """Records ``function`` on ``stream`` (a recording runs the Python but not the kernels: the state advances only
    when the graph is replayed). Graphs replayed one after the other in recording order may share a ``pool``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        function()
    return graph


def warm_up_and_record(warm_up_fn: Callable[[], None], record_fn: Callable[[], None], pool=None):
    """[`warm_up`] then [`record`] on the same stream."""
    return record(record_fn, warm_up(warm_up_fn), pool)
