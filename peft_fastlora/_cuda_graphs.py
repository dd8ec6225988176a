"""What the CUDA-graph recorders (graphed generation, the graphed training step) share: when a recording is stale,
and how one is made."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn


def adapter_flags(module: nn.Module) -> Optional[tuple]:
    """``(active adapters, disabled, merged)`` of a PEFT adapter layer (a recording bakes them in); None for a module
    that is not one."""
    active = getattr(module, "active_adapters", None)
    if active is None or callable(active):
        return None
    return tuple(active), getattr(module, "disable_adapters", False), getattr(module, "merged", False)


def model_fingerprint(model: nn.Module) -> int:
    """Changes with what a recorded graph has baked in: the address of every parameter and buffer (replaced by a
    merge or an adapter load; an optimizer step updates them in place and keeps them), each adapter layer's active
    adapters, disabled and merged flags, and train/eval mode."""
    state: list = [model.training]
    state += [t.data_ptr() for t in model.parameters()]
    state += [t.data_ptr() for t in model.buffers()]
    state += [flags for flags in map(adapter_flags, model.modules()) if flags is not None]
    return hash(tuple(state))


class RecordedModel:
    """What a recording baked in of a model, checked per replay at a fraction of [`model_fingerprint`]'s cost (it
    walks every module by name, milliseconds on a slow host for an 8-layer PEFT model): the module tree (a layer
    swapped, e.g. by ``merge_and_unload``), every parameter and buffer (the same tensor object at the same address),
    each adapter layer's active adapters and disabled / merged flags, and train/eval mode of the top module.

    The check runs before every replay while the GPU waits (in a loop that syncs each step, as one that logs its loss
    does): on an H200's host the whole per-replay check of `GraphedTrainStep` took 0.54 ms at batch 1, 1.5 % of the
    recorded step. So its loops are ``map``s over flat columns, run in C, not Python generators: on an 8-layer
    fast-path model (917 entries, 245 tensors, 58 adapter layers) 264 µs a check as generators, 106 µs now (2-core
    CPU host)."""

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        self.model, self.training = model, model.training
        tree = [(m._modules, name, child) for m in modules for name, child in m._modules.items()]
        tensors = [(table, name, t) for m in modules for table in (m._parameters, m._buffers)
                   for name, t in table.items() if t is not None]  # fmt: skip
        # columns: each lookup table (a module's _modules / _parameters / _buffers), the name in it, what it held
        entries = tree + tensors
        self._tables = [table for table, _, _ in entries]
        self._names = [name for _, name, _ in entries]
        self._held = [held for _, _, held in entries]
        self._tensors = [t for _, _, t in tensors]
        self._pointers = self._addresses()
        self.adapters = [m for m in modules if adapter_flags(m) is not None]
        self.adapter_state = self._adapter_state()

    def _adapter_state(self) -> list:
        return [adapter_flags(m) for m in self.adapters]

    def _addresses(self) -> list[int]:
        # Without subclasses' __torch_function__ (bitsandbytes' Params4bit has one), which made each data_ptr() 4x
        # the cost: 148 against 34 µs for the 245 tensors of that model. The address is the storage's either way.
        with torch._C.DisableTorchFunctionSubclass():
            return list(map(torch.Tensor.data_ptr, self._tensors))

    def unchanged(self) -> bool:
        return (self.model.training == self.training
                and all(map(operator.is_, map(dict.get, self._tables, self._names), self._held))
                and self._addresses() == self._pointers
                and self._adapter_state() == self.adapter_state)  # fmt: skip


class RngState:
    """The CPU generator's state and that of each given CUDA device's default generator, to put back after work that
    must not count (the warm-up before a recording)."""

    def __init__(self, devices: list[int]) -> None:
        self.devices = devices
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in devices]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)


# The side stream of every warm-up and recording, one per device. cuBLAS keeps a workspace for each stream it has run
# on (allocated through torch's caching allocator and freed only by torch._C._cuda_clearCublasWorkspaces), so a new
# stream per recording left one more workspace allocated each time a step or a generation was recorded again.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: Optional[int] = None) -> torch.cuda.Stream:
    """The side stream that warm-ups and recordings on ``device`` (default: the current one) run on."""
    index = torch.cuda.current_device() if device is None else device
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def warm_up(function: Callable[[], None]) -> torch.cuda.Stream:
    """Runs ``function`` (real work: Triton compiles, cuBLAS sets up the stream's workspace, Inductor compiles) on the
    device's [`side_stream`] and makes the current stream wait for it; returns that stream, to record on."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    return stream


def record(function: Callable[[], None], stream: torch.cuda.Stream, pool=None) -> torch.cuda.CUDAGraph:
    """Records ``function`` on ``stream`` (a recording runs the Python but not the kernels: the state advances only
    when the graph is replayed). Graphs replayed one after the other in recording order may share a ``pool``."""
    graph = torch.cuda.CUDAGraph()
    generator = torch.cuda.default_generators[stream.device.index or 0]  # what a capture registers by default
    before = generator.clone_state()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            function()
    except BaseException:
        # A capture that fails never reaches the generator's capture epilogue: the device's RNG stays in capture
        # mode and every later random op raises ("Offset increment outside graph capture"). Put its state back.
        generator.graphsafe_set_state(before)
        raise
    return graph


def warm_up_and_record(warm_up_fn: Callable[[], None], record_fn: Callable[[], None], pool=None):
    """[`warm_up`] then [`record`] on the same stream."""
    return record(record_fn, warm_up(warm_up_fn), pool)
