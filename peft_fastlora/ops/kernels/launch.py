"""Low-overhead Triton launches for kernels called on every layer call, and the small launch utilities.

``kernel[grid](...)`` costs tens of microseconds of Python per call (Triton 3.6-3.9 bind every argument, read its
knobs and build a cache key from strings), which is as long as the 4096x4096 dequant itself. Here the first launch of
a given specialization goes through ``kernel[grid]`` (compiling if needed) and keeps the returned ``CompiledKernel``;
later launches call its launcher directly (``run_compiled``: ``CompiledKernel.run``, the same call and arguments that
``JITFunction.run`` makes in Triton 3.6 and 3.9).

Caching: ``_compiled`` maps (kernel, device index, specialization key, launch options) to a ``CompiledKernel``. The
key covers everything Triton specializes on, and more: every tensor argument's dtype and 16-byte alignment, every
int/bool/constexpr argument by value, floats by type, and the launch options; the device index keeps a kernel loaded
on one GPU from being launched on another. It is bounded by ``MAX_COMPILED`` entries: when full it is emptied, and
the next launches go through ``kernel[grid]`` again (Triton's own cache makes that a lookup, not a compile).
"""

from __future__ import annotations

import contextlib

import torch
import triton

MAX_COMPILED = 4096
_compiled: dict = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids; ``triton.cdiv`` is a JIT-callable object in Triton 3.9 (microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), like ``triton.next_power_of_2`` without its overhead."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` runs under the Triton interpreter (``TRITON_INTERPRET=1`` when Triton was imported)."""
    return type(kernel).__name__ == "InterpretedFunction"


def require_launchable(kernel, device: torch.device) -> None:
    """CPU tensors need the Triton interpreter; say so instead of failing inside Triton."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got tensors on {device}. Set `TRITON_INTERPRET=1` before importing "
            "triton to run them on CPU, or use `peft_fastlora.ops.reference` instead."
        )


_PLAIN = frozenset({int, bool, str, type(None)})


def _specialization(args: tuple) -> tuple:
    # Runs on every launch (~40 arguments): plain values first, one type lookup each; tensors by dtype and alignment.
    return tuple(
        [
            a if type(a) in _PLAIN
            else "f" if type(a) is float
            else (a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
            else a
            for a in args
        ]
    )


def _launch_hooks_set() -> bool:
    """Whether a launch hook is installed (Triton 3.6+: ``HookChain`` objects, older: a callable or None)."""
    runtime = triton.knobs.runtime
    return any(getattr(h, "calls", h) for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _current_device() -> int:
    """The current CUDA device. ``torch.cuda.current_device`` adds a lazy-init check to every call; a launch has CUDA
    tensors, so CUDA is up and the raw getter is enough (CPU-only builds of torch lack it; nothing launches there)."""
    return torch._C._cuda_getDevice()


def device_context(device: torch.device):
    """Makes ``device`` current for the launch, skipping the switch when it already is (the usual case)."""
    if device.type != "cuda" or device.index is None or device.index == _current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def launch_is_direct(device: torch.device) -> bool:
    """Whether a kernel compiled earlier may be launched straight on ``device`` now: it is the current CUDA device
    (its module is loaded in that device's context) and no Triton launch hook (e.g. a profiler's) wants to see it."""
    return device.index == _current_device() and not _launch_hooks_set()


def run_compiled(compiled, grid: tuple, args, device_index: int) -> None:
    """Runs a ``CompiledKernel`` on the current stream of ``device_index``: the call ``JITFunction.run`` makes in
    Triton 3.6 and 3.9 (``grid`` has three entries)."""
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args
    )


def launch(kernel, grid: tuple, args: tuple, device: torch.device, **options):
    """Launches ``kernel`` on ``device`` with ``args`` = every kernel parameter in order (constexprs included).

    ``options`` are launch options (``num_warps``, ``enable_fp_fusion``, ...). Interpreted kernels and Triton launch
    hooks (e.g. a profiler's) always take the regular ``kernel[grid]`` path. Returns the ``CompiledKernel`` that ran
    (None under the interpreter), which a caller holding a prepared launch may run again directly for arguments of
    the same specialization (see ``small_m.SmallMLaunch``).
    """
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if is_interpreted(kernel):
        kernel[grid](*args, **options)
        return None
    current = _current_device()
    index = current if device.index is None else device.index
    # options in the caller's keyword order: each call site passes them in one order, so sorting bought nothing
    key = (kernel, index, _specialization(args), *options.items())
    compiled = _compiled.get(key)
    if compiled is not None and index == current and not _launch_hooks_set():
        run_compiled(compiled, grid, args, index)  # the usual case: no device switch, no context manager
        return compiled
    with device_context(device):
        if compiled is None or _launch_hooks_set():
            compiled = kernel[grid](*args, **options)
            if compiled is None or hasattr(compiled, "result"):  # an async-compile future: not a kernel to keep
                return None
            if len(_compiled) >= MAX_COMPILED:
                _compiled.clear()
            _compiled[key] = compiled
            return compiled
        run_compiled(compiled, grid, args, index)
        return compiled
