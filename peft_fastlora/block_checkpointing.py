"""What gradient checkpointing does per decoder block under the fast path: which block it recomputes, and where the
inputs it keeps live.

- **The last block is not recomputed** (default; ``enable_fast_path(recompute_last_block=True)`` restores it): its
  backward is the first to run, right after the loss, so checkpointing it only repeats its forward moments later to
  rebuild the activations that forward just dropped. Kept, they are live during the loss as well, where a
  checkpointed step keeps nothing of that block; the backward of that block needs the same activations either way, so
  the peak moves only where the loss needs more than the block's backward (docs/fast-path.md has the measurement).
- **Activation offload** (opt-in): the inputs that checkpointing keeps between blocks go to pinned CPU memory on a
  side stream and come back for the backward pass.

Both act by wrapping each block's ``_gradient_checkpointing_func``, the function transformers calls to checkpoint a
block (``GradientCheckpointingLayer``). Enabling checkpointing later sets those functions anew (the Trainer does, at the
start of ``train()``), so the model's ``_set_gradient_checkpointing`` is replaced (on this instance) by one that applies
the policy again after the class's own. The wrappers are small objects rather than closures: a model holding them still
pickles and deep-copies (without offload hooks, which hold CUDA streams).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ._forward import InstanceForward
from .ops.lora_linear import kept_under_checkpointing

# The model's CpuOffloadHooks (one per model, in its __dict__), for code that must reach them (a recorded step).
OFFLOAD_HOOKS = "_fastlora_offload_hooks"
# The model's CheckpointPolicy, in its __dict__.
POLICY = "_fastlora_checkpoint_policy"
# Checkpointed inputs smaller than this stay on the GPU: the copy would cost more than the memory it frees.
OFFLOAD_MIN_BYTES = 1 << 20


@dataclass
class CheckpointPolicy:
    """How a model's decoder blocks are checkpointed (see the module docstring).

    Args:
        blocks (`list[nn.Module]`): The decoder blocks, in order.
        recompute_last_block (`bool`): Whether the last block is checkpointed like the others.
        offload (`CpuOffloadHooks`, *optional*): Hooks that move the checkpointed inputs to CPU memory.
    """

    blocks: list[nn.Module]
    recompute_last_block: bool = True
    offload: Optional[CpuOffloadHooks] = None

    def wrap(self) -> None:
        """Gives each checkpointed block the checkpoint function this policy asks for, made from the one
        transformers set (never wrapping a wrapper)."""
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            func = block.__dict__.get("_gradient_checkpointing_func")
            if func is None:
                continue
            original = func.__wrapped__ if isinstance(func, (_NotRecomputed, _Offloading)) else func
            if index == last and not self.recompute_last_block:
                block._gradient_checkpointing_func = _NotRecomputed(original)
            elif self.offload is not None:
                block._gradient_checkpointing_func = _Offloading(original, self.offload)
            else:
                block._gradient_checkpointing_func = original


def apply_checkpoint_policy(hf_model: nn.Module, blocks: list[nn.Module], *, recompute_last_block: bool,
                            offload: bool, notes: list[str]) -> tuple[bool, bool]:  # fmt: skip
    """Sets ``hf_model``'s [`CheckpointPolicy`] (replacing an earlier one) and applies it now and whenever
    checkpointing is enabled again; returns ``(last block kept, inputs offloaded)``, with a note in ``notes`` for
    what was asked but cannot apply."""
    can_checkpoint = bool(blocks) and hasattr(hf_model, "_set_gradient_checkpointing")
    hooks = None
    if offload and not any(p.is_cuda for p in hf_model.parameters()):
        notes.append("activation offload off (model not on CUDA: activations are already in CPU memory)")
    elif offload and not can_checkpoint:
        notes.append("activation offload off (no checkpointable decoder blocks)")
    elif offload:
        # room for a few forwards' worth of block inputs before a backward (see CpuOffloadHooks.max_unrestored)
        hooks = hf_model.__dict__.setdefault(OFFLOAD_HOOKS, CpuOffloadHooks(max_unrestored=4 * len(blocks)))
    if not can_checkpoint:
        return False, False
    policy = CheckpointPolicy(blocks, recompute_last_block, hooks)
    hf_model.__dict__[POLICY] = policy
    policy.wrap()
    setter = hf_model.__dict__.get("_set_gradient_checkpointing")
    if not (isinstance(setter, InstanceForward) and setter.__func__ is _set_gradient_checkpointing):
        hf_model._set_gradient_checkpointing = InstanceForward(_set_gradient_checkpointing, hf_model,
                                                               type(hf_model)._set_gradient_checkpointing)
    if hooks is not None and not any(getattr(b, "gradient_checkpointing", False) for b in blocks):
        notes.append("activation offload applies once gradient checkpointing is enabled")
    return not recompute_last_block, hooks is not None


def _set_gradient_checkpointing(model: nn.Module, *args, **kwargs):
    """The model class's ``_set_gradient_checkpointing``, then the model's policy on the functions it set."""
    result = type(model)._set_gradient_checkpointing(model, *args, **kwargs)
    model.__dict__[POLICY].wrap()
    return result


class _NotRecomputed:
    """In place of a block's checkpoint function: runs the block as it is (autograd keeps what its backward needs),
    marked as kept under checkpointing (its fused ops' backward then cuts weights into windows, as a recomputed
    block's does: ``ops.lora_linear.fused_op_windows``)."""

    def __init__(self, checkpoint_func):
        self.__wrapped__ = checkpoint_func

    def __call__(self, function, *args, **kwargs):
        # Under torch.compile the mark would be a context variable for dynamo to trace, and would mark nothing: a
        # compiled region runs the reference ops, which take no windows.
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        with kept_under_checkpointing():
            return function(*args, **kwargs)


class _Offloading:
    """A block's checkpoint function with its saved inputs (the block inputs the recompute starts from) offloaded:
    inside the checkpoint its own saved-tensor hooks take over, so only what the checkpoint itself keeps reaches
    ``hooks``."""

    def __init__(self, checkpoint_func, hooks: CpuOffloadHooks):
        self.__wrapped__ = checkpoint_func
        self.hooks = hooks

    def __call__(self, function, *args, **kwargs):
        with self.hooks:
            return self.__wrapped__(function, *args, **kwargs)


# ---- activation offload --------------------------------------------------------------------------------------------


class CpuOffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep large CUDA activations in pinned CPU memory.

    The device-to-host copy runs on a side stream that waits for the producing stream, so the forward pass does not
    wait for PCIe. The GPU tensor is held until the next offload (or the first restore), which makes the compute
    stream wait for the copy and then drops it: its memory returns to the compute stream's pool, ordered after the
    copy. (``record_stream`` would free it too, but a block used by a side stream is not reused while a CUDA graph
    records, so a recorded checkpointed step kept every block input: 0.1 GiB at batch 1 of the benchmark model.)

    The backward pass restores the block inputs in the reverse order of the forward, so restoring one starts the
    host-to-device copy of the one offloaded before it, on the side stream, into memory of the compute stream's pool:
    that copy runs while the compute stream works through the block it just restored, and the next restore only waits
    for it. (Copied on the compute stream when asked for, each block input held the GPU for its whole copy: 64 MB at
    ~50 GB/s, ~1.3 ms per block at batch 4 of the benchmark model.) One restored-ahead input is on the GPU at a time.
    """

    def __init__(self, min_bytes: int = OFFLOAD_MIN_BYTES, max_unrestored: int = 256):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Forwards whose graph is dropped without a backward never restore what they offloaded; past this many entries
        # the oldest leave the list below (so pinned buffers of dead graphs are not kept): they are then only not
        # restored ahead, which is always safe (no entry has a copy in flight before a backward starts restoring).
        self.max_unrestored = max_unrestored
        # While a CUDA graph records the step, the pinned buffers it copies into must outlive the recording (a graph
        # replays into the same addresses): [`retaining`] collects them here.
        self.retained: Optional[list[torch.Tensor]] = None
        # (GPU tensor, its copy's event) for copies the compute stream has not waited for yet
        self.pending: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # what the forward offloaded, in order, not yet restored; and whether a restore happened since the last offload
        self.offloaded: list[_Offloaded] = []
        self._restoring = False
        super().__init__(functools.partial(_pack, self, min_bytes), functools.partial(_unpack, self))

    def release_copied(self) -> None:
        """Makes the compute stream wait for the pending copies, then drops their GPU tensors."""
        pending, self.pending = self.pending, []
        for tensor, done in pending:
            torch.cuda.current_stream(tensor.device).wait_event(done)

    def forget_unrestored(self) -> None:
        """Drops what a previous backward pass left unrestored (its restored-ahead copies joined first, so that no
        side-stream work is left behind)."""
        for item in self.offloaded:
            item.drop_ahead()
        self.offloaded = []
        self._restoring = False

    @contextlib.contextmanager
    def retaining(self, keep: list[torch.Tensor]):
        """Appends every pinned buffer made inside the context to ``keep``."""
        previous, self.retained = self.retained, keep
        try:
            yield keep
        finally:
            self.retained = previous

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


class _Offloaded:
    """A tensor in pinned CPU memory: its copy's event, and the GPU copy restored ahead of time, if any."""

    __slots__ = ("device", "host", "done", "stride", "ahead")

    def __init__(self, device: torch.device, host: torch.Tensor, done: torch.cuda.Event, stride: tuple):
        self.device, self.host, self.done, self.stride = device, host, done, stride
        self.ahead: Optional[tuple[torch.Tensor, torch.cuda.Event]] = None

    def restore_ahead(self, side: torch.cuda.Stream) -> None:
        """Starts the copy back on ``side``, into memory allocated on the compute stream (the compute stream only
        touches it after waiting for the copy, and frees it after that use)."""
        compute = torch.cuda.current_stream(self.device)
        restored = torch.empty_strided(self.host.shape, self.stride, dtype=self.host.dtype, device=self.device)
        side.wait_stream(compute)  # the allocation, and the copy to the host (same side stream), come first
        with torch.cuda.stream(side):
            restored.copy_(self.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        self.ahead = (restored, ready)

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ahead[1])
            self.ahead = None

    def restore(self) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        if self.ahead is not None:
            restored, ready = self.ahead
            self.ahead = None
            compute.wait_event(ready)
            return restored
        compute.wait_event(self.done)
        restored = torch.empty_strided(self.host.shape, self.stride, dtype=self.host.dtype, device=self.device)
        return restored.copy_(self.host, non_blocking=True)


def _pack(hooks: CpuOffloadHooks, min_bytes: int, tensor: torch.Tensor):
    if not tensor.is_cuda or isinstance(tensor, nn.Parameter) or tensor.numel() * tensor.element_size() < min_bytes:
        return tensor
    hooks.release_copied()
    if hooks._restoring:  # a new forward pass: what the last backward did not restore is not coming back
        hooks.forget_unrestored()
    elif len(hooks.offloaded) >= hooks.max_unrestored:
        del hooks.offloaded[0]
    side = hooks.stream(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if hooks.retained is not None:
            hooks.retained.append(host)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    hooks.pending.append((tensor, done))
    item = _Offloaded(tensor.device, host, done, tensor.stride())
    hooks.offloaded.append(item)
    return item


def _unpack(hooks: CpuOffloadHooks, packed):
    if isinstance(packed, torch.Tensor):
        return packed
    hooks.release_copied()
    hooks._restoring = True
    restored = packed.restore()
    offloaded = hooks.offloaded
    index = next((i for i in range(len(offloaded) - 1, -1, -1) if offloaded[i] is packed), None)
    if index is not None:  # (None: restored once already; it comes back from the host again)
        del offloaded[index]
        if index > 0 and offloaded[index - 1].ahead is None:  # the one the backward pass restores next
            offloaded[index - 1].restore_ahead(hooks.stream(packed.device))
    return restored
