"""Launcher of the fused small-M kernel (``small_m_kernel.py``): tiling, workspaces, arguments, launch.

[`small_m_linear`] takes arguments that ``peft_fastlora.ops.dispatch`` has checked, views them as 2-D rows, picks
the tiling ([`pick_config`]: the tuning table for this GPU and shape, else [`heuristic_config`]), allocates the
output and the kernel's workspaces and launches once. [`small_m_linear_tiled`] runs an explicit tiling (tests,
``benchmarks/tune_small_m.py``).

Caching (all keyed by everything they read): ``pick_config`` by (rows, shape, device, kind); ``small_m_grid`` by
(rows, shape, tiling, rank), pure arithmetic; ``small_m_limit`` by (device, kind, shape); the weight's pointer
arguments (and its int32-word view) on the container (``quant_state.memo``) by ``block_k``; the SM count by device
index.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from ..quant_state import Int8Rowwise, QuantizedWeight, memo
from .dequant import nested_args, packed_bytes
from .launch import (
    cdiv,
    is_interpreted,
    launch,
    launch_is_direct,
    next_power_of_2,
    require_launchable,
    run_compiled,
)
from .small_m_kernel import WEIGHT_4BIT_ALIGNED, WEIGHT_4BIT_ANY, WEIGHT_INT8, _fused_small_m_kernel
from .tuning import BLOCK_MS, SmallMConfig, tuned_config, tuned_crossover

# Rows up to which the dispatcher uses this kernel for a shape the tuning table does not list. With the heuristic's
# tiling it beat dequant + cuBLAS up to 24 rows on each of 12 untabled Llama-3.2 / Qwen2.5 shapes on an H100, and up to
# 32 on all but one (2048 x 2048: a tie at 32, 0.98-1.00x); at 48 rows it lost on 5 of them (docs/benchmarks.md).
SMALL_M_MAX = 32

# xa = x_lora @ A.T is cut into at most this many K chunks, each made by one program (see small_m_kernel.py).
XA_MAX_CHUNKS = 16
# Counter polls (one L2 atomic each) before an epilogue makes the xa chunks itself. The producers are the first
# programs dispatched, so on a GPU the count is normally complete at the first poll; the bound only guarantees
# progress whatever the scheduler does.
XA_POLLS = 1 << 14
# Each M tile's chunk counter is kept in this many copies, one 128-byte line apart: the epilogues of different
# N tiles poll different copies instead of all one address.
XA_COPIES, XA_COPY_STRIDE = 8, 32


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def weight_kind(weight: QuantizedWeight) -> str:
    """``"int8"`` or ``"nf4"`` (every 4-bit weight): the key of the tuning table."""
    return "int8" if isinstance(weight, Int8Rowwise) else "nf4"


def small_m_limit(weight: QuantizedWeight, device: torch.device) -> int:
    """Most rows for which the dispatcher picks this kernel: the tabled crossover, else ``SMALL_M_MAX``."""
    n, k = weight.shape
    return _small_m_limit(device, weight_kind(weight), n, k)


# A constant for torch.compile: dynamo cannot trace the table lookup (torch.cuda.get_device_name returns a str), so
# it calls this at trace time. (dynamo does not honour the mark on an lru_cache wrapper, hence two functions.)
@torch.compiler.assume_constant_result
def _small_m_limit(device: torch.device, kind: str, n: int, k: int) -> int:
    return _tabled_small_m_limit(device, kind, n, k)


@functools.lru_cache(maxsize=1024)
def _tabled_small_m_limit(device: torch.device, kind: str, n: int, k: int) -> int:
    crossover = tuned_crossover(device, kind, n, k)
    return SMALL_M_MAX if crossover is None else crossover


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, device: torch.device, kind: str = "nf4") -> SmallMConfig:
    """The tiling for ``m`` rows of an ``(n, k)`` weight: the tuning table's when tabled, else the heuristic's."""
    return tuned_config(device, kind, m, n, k) or heuristic_config(m, n, k, device, kind)


def heuristic_config(m: int, n: int, k: int, device: torch.device, kind: str = "nf4") -> SmallMConfig:
    """Default tiling: FMAs for one row, tensor cores otherwise; K is split until the SMs hold enough programs.

    One row: 8 x 512 tiles; for 4-bit weights on one warp (the M = 1 path decodes whole words per thread; the best
    tile of the H100 tuning) with K split towards ~24 programs per SM, for int8 on 4 warps, ~6 per SM. Several rows:
    64 x 128 tensor-core tiles on 4 warps in programs of the fewest of 16 / 32 / 64 rows that hold ``m`` (each
    program decodes its weight tile once for all its rows), ~6 programs per SM with 16 rows and ~4 with more (every
    split adds ``m`` x ``n`` fp32 partial sums). That is what the H100 tuning chose for Llama-3-8B's and Qwen2-7B's
    shapes: their M > 1 tilings are 64 x 128 (a few 128 x 64 or 64 x 64) at 4 warps, in 32- and 64-row programs past
    16 rows. The tiles keep registers below ~128 per thread so that several programs share an SM: with the prefetch,
    the bytes in flight (what bounds a weight-streaming kernel) grow with the number of resident programs.
    """
    block_m = 16
    if m == 1 and kind == "nf4":
        block_n, block_k, warps, per_sm = 8, 512, 1, 24
    elif m == 1:
        block_n, block_k, warps, per_sm = 8, 512, 4, 6
    else:
        block_m = next((rows for rows in BLOCK_MS if rows >= m), BLOCK_MS[-1])
        block_n, block_k, warps, per_sm = 64, 128, 4, 6 if block_m == 16 else 4
    block_k = min(block_k, max(16, next_power_of_2(k)))
    if device.type != "cuda":  # the interpreter: fewest programs is fastest
        block_n = min(block_n, max(16, next_power_of_2(n)))
        return SmallMConfig(use_dot=m > 1, block_n=block_n, block_k=block_k, block_m=block_m)
    tiles = max(1, cdiv(n, block_n) * cdiv(m, block_m))  # zero rows: a call that launches nothing
    k_tiles = cdiv(k, block_k)
    target = per_sm * _sm_count(device.index or 0)  # programs
    split_k = max(1, min(cdiv(target, tiles), k_tiles, 16))
    if m == 1:
        # The launcher gives each split cdiv(k_tiles, split_k) whole tiles, so a wanted split runs as fewer: 7 of
        # 4096x4096's 8 tiles ran as 4 splits of two. Of the split with that rounding and the one rounding the tiles
        # per split down instead, take the one whose program count is nearest the target (H100, nf4, one row: 8
        # splits there and on 2048x8192's 16 tiles 1.09x / 1.10x faster; rounding down everywhere was 4 % slower on
        # 8192x3072, where the nearest keeps 3 of 6).
        options = {cdiv(k_tiles, cdiv(k_tiles, split_k)), min(cdiv(k_tiles, max(1, k_tiles // split_k)), 16)}
        split_k = min(options, key=lambda s: (abs(math.log2(tiles * s / target)), -s))
    return SmallMConfig(
        use_dot=m > 1, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, block_m=block_m
    )


def xa_chunking(k: int, programs_per_m_tile: int) -> tuple[int, int, int]:
    """(XA_BLOCK_K, chunk, n_chunks) of ``xa = x_lora @ A.T``: at most ``XA_MAX_CHUNKS`` chunks and no more than the
    programs that make them; ``chunk`` is a multiple of ``XA_BLOCK_K``."""
    xa_block_k = min(128, max(16, next_power_of_2(k)))
    wanted = min(XA_MAX_CHUNKS, programs_per_m_tile)
    chunk = max(xa_block_k, next_power_of_2(cdiv(k, wanted)))
    return xa_block_k, chunk, cdiv(k, chunk)


@dataclass(frozen=True)
class SmallMGrid:
    """Grid, K split, xa chunking and workspace sizes of a launch: what depends on sizes and tiling only."""

    grid: tuple[int, int, int]
    k_per_split: int
    split_k: int
    block_m: int
    block_r: int
    xa_block_k: int
    xa_chunk: int
    n_chunks: int
    n_partials: int  # fp32 split-K partials (0: no split)
    n_xa_parts: int  # fp32 xa chunk partials (0: no LoRA term)
    n_arrivals: int  # int32 zeros: split-K arrivals, then the xa chunk counters
    n_xa_counts: int


@functools.lru_cache(maxsize=4096)
def small_m_grid(m: int, n: int, k: int, config: SmallMConfig, r: Optional[int]) -> SmallMGrid:
    """``r``: the LoRA rank, or None for no LoRA term."""
    has_lora = r is not None
    block_m = config.rows_per_program
    block_n, block_k = config.block_n, config.block_k
    k_per_split = cdiv(cdiv(k, block_k), config.split_k) * block_k
    split_k = cdiv(k, k_per_split)  # no empty splits
    grid = (cdiv(n, block_n), split_k, cdiv(m, block_m))
    block_r = max(16, next_power_of_2(r or 0))
    xa_block_k, xa_chunk, n_chunks = xa_chunking(k, grid[0] * grid[1]) if has_lora else (16, k, 0)
    return SmallMGrid(
        grid=grid,
        k_per_split=k_per_split,
        split_k=split_k,
        block_m=block_m,
        block_r=block_r,
        xa_block_k=xa_block_k,
        xa_chunk=xa_chunk,
        n_chunks=n_chunks,
        n_partials=split_k * m * n if split_k > 1 else 0,
        n_xa_parts=grid[2] * XA_MAX_CHUNKS * block_r * block_m if has_lora else 0,
        n_arrivals=grid[0] * grid[2] if split_k > 1 else 0,
        n_xa_counts=grid[2] * XA_COPIES * XA_COPY_STRIDE if has_lora else 0,
    )


def _weight_args(weight: QuantizedWeight, block_k: int) -> tuple[tuple, tuple]:
    """(w_ptr .. offset_ptr, stride_wn) and (WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB) of ``weight``."""
    if isinstance(weight, Int8Rowwise):
        scb = weight.scb
        return (weight.cb, scb, scb, scb, scb, scb, weight.cb.stride(0)), (WEIGHT_INT8.value, 1, False, 1, block_k)
    k, bs = weight.shape[1], weight.blocksize
    kind = WEIGHT_4BIT_ALIGNED if k % bs == 0 else WEIGHT_4BIT_ANY
    nested_code, nested_absmax, offset, nested_bs = nested_args(weight)
    pointers = (packed_bytes(weight), weight.absmax, weight.code, nested_code, nested_absmax, offset, k // 2)
    return pointers, (kind.value, bs, weight.nested, nested_bs, min(bs, block_k))


def _words_args(weight: QuantizedWeight, block_k: int) -> tuple:
    """The FACTOR_SCALES path's ``(w_ptr, stride_wn)``: the packed 4-bit weight as int32 words (8 elements) and words
    per row; ``()`` when it cannot be read that way (rows not whole absmax blocks, or codes not 4-byte aligned)."""
    if isinstance(weight, Int8Rowwise):
        return ()
    k, bs = weight.shape[1], weight.blocksize
    packed = packed_bytes(weight)
    if k % bs or min(bs, block_k) % 8 or packed.data_ptr() % 4 or packed.numel() % 4:
        return ()
    return packed.view(torch.int32), k // 8


def packs_dot(config: SmallMConfig, dtype: torch.dtype, factor_scales: bool, interpret: bool) -> bool:
    """Whether a launch runs the packed M = 1 path (``PACKED_DOT``): asked for by ``config``, on the factored path,
    bf16 rows (a bf16x2 sum has fp32's range; an fp16x2 one could overflow where the fp32 sums do not), compiled
    kernels (inline PTX; the interpreter runs the shuffle path's gather twin)."""
    return config.packed_dot and factor_scales and dtype == torch.bfloat16 and not interpret


# The kernel's parameters in order: the launcher builds its argument tuple positionally in this order (keyword
# binding of 53 arguments cost ~6 us of host time per decode call), and this list is checked against the kernel's
# signature here, at import, so that an edit of either one cannot silently shift arguments.
KERNEL_PARAMS = (
    "x_ptr", "w_ptr", "absmax_ptr", "code_ptr", "nested_code_ptr", "nested_absmax_ptr", "offset_ptr", "bias_ptr",
    "lx_ptr", "lora_a_ptr", "lora_b_ptr", "out_ptr", "partial_ptr", "arrivals_ptr", "xa_part_ptr", "xa_count_ptr", "M",
    "N", "K", "R", "scaling", "stride_xm", "stride_wn", "stride_lxm", "stride_an", "stride_bn", "stride_om",
    "k_per_split", "n_chunks", "xa_chunk", "WEIGHT_KIND", "BLOCKSIZE", "NESTED", "NESTED_BLOCKSIZE", "SUB", "HAS_BIAS",
    "HAS_LORA", "USE_DOT", "DOT_FP32", "LORA_DOT_FP32", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "SPLIT_K",
    "XA_BLOCK_K", "XA_MAX_CHUNKS", "XA_COPIES", "XA_COPY_STRIDE", "XA_POLLS", "INTERPRET", "FACTOR_SCALES", "MUL_RN",
    "SHUFFLE_LUT", "PACKED_DOT", "LOAD_STAGES",
)  # fmt: skip
assert KERNEL_PARAMS == tuple(inspect.signature(_fused_small_m_kernel.fn).parameters)


# Slots of the argument tuple that change from call to call (see SmallMLaunch).
_X, _BIAS, _LX, _LORA_A, _LORA_B, _OUT, _PARTIAL, _ARRIVALS, _XA_PART, _XA_COUNT = 0, 7, 8, 9, 10, 11, 12, 13, 14, 15
_SCALING, _STRIDE_XM, _STRIDE_LXM = 20, 21, 23


class SmallMLaunch:
    """The kernel's launch for one weight, bias, adapter pair, row count, dtype and tiling, prepared once.

    Building the argument tuple (weight fields, tiling, grid, workspace sizes) and matching the compiled kernel to it
    cost more host time than the launch itself; a layer that decodes calls the same launch on every token, so it
    prepares it once and calls it with each token's rows. Calls with the rows' alignment and strides of the first
    call launch the kernel compiled for them directly; any other rows go through [`launch`], which matches them
    again. Outputs and workspaces are allocated per call (concurrent calls and CUDA graphs never share them); the
    weight, bias and adapter tensors are read at launch time, so in-place updates of them are seen.

    Args:
        m (`int`): Rows of every call.
        dtype (`torch.dtype`): The rows' (and the output's) dtype.
        weight, bias, lora_a, lora_b: As for [`small_m_linear_tiled`] (``lora_a``/``lora_b`` both given or both
            ``None``; ``bias``, ``lora_a`` and ``lora_b`` contiguous).
        config ([`SmallMConfig`]): The tiling.
    """

    def __init__(self, m, dtype, weight, bias, lora_a, lora_b, config):
        n, k = weight.shape
        device = weight.device
        self.m, self.n, self.k, self.dtype, self.device = m, n, k, dtype, device
        self.has_lora, self.has_bias = lora_a is not None, bias is not None
        r = lora_a.shape[0] if self.has_lora else 0
        plan = small_m_grid(m, n, k, config, r if self.has_lora else None)
        self.grid = plan.grid
        # Workspace sizes: fp32 split-K partials, fp32 xa chunk partials, int32 arrival and xa chunk counters.
        self.sizes = (plan.n_partials, plan.n_xa_parts, plan.n_arrivals, plan.n_xa_counts)
        w_args, w_meta = memo(weight, ("small_m", config.block_k), lambda: _weight_args(weight, config.block_k))
        factor_scales = config.factor_scales and not config.use_dot and w_meta[0] == WEIGHT_4BIT_ALIGNED.value
        if factor_scales:
            words = memo(weight, ("small_m_words", config.block_k), lambda: _words_args(weight, config.block_k))
            factor_scales = bool(words)
            if factor_scales:
                w_args = (words[0], *w_args[1:6], words[1])
        interpret = is_interpreted(_fused_small_m_kernel)
        require_launchable(_fused_small_m_kernel, device)
        self.packed_dot = packs_dot(config, dtype, factor_scales, interpret)
        # fp fusion stays on (FMAs in the dot products): the only sums that must not fuse, in the nested-absmax
        # decode, use mul.rn (MUL_RN). The interpreter computes exactly as written.
        self.options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        # In KERNEL_PARAMS order; None marks the per-call slots (x, out, workspaces, scaling, row strides), and the
        # unused pointers (no bias, no LoRA, no workspace) point at the call's output.
        self.args = (
            None, *w_args[:6], bias, None, lora_a, lora_b, None, None, None, None, None,
            # M, N, K, R, scaling, stride_xm, stride_wn, stride_lxm, stride_an, stride_bn, stride_om
            m, n, k, r, None, None, w_args[6], None, lora_a.stride(0) if self.has_lora else 0,
            lora_b.stride(0) if self.has_lora else 0, n,
            plan.k_per_split, plan.n_chunks, plan.xa_chunk,
            *w_meta,  # WEIGHT_KIND, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, SUB
            self.has_bias,  # HAS_BIAS
            self.has_lora,  # HAS_LORA
            config.use_dot,  # USE_DOT
            interpret or dtype == torch.float32,  # DOT_FP32: the interpreter's bf16 dot is not exact
            interpret or (self.has_lora and lora_a.dtype == torch.float32),  # LORA_DOT_FP32
            plan.block_m, config.block_n, config.block_k, plan.block_r, plan.split_k, plan.xa_block_k,
            XA_MAX_CHUNKS, XA_COPIES, XA_COPY_STRIDE,
            # XA_POLLS: the interpreter runs programs one by one, a count stays incomplete
            0 if interpret else XA_POLLS,
            interpret,  # INTERPRET
            factor_scales,  # FACTOR_SCALES
            not interpret,  # MUL_RN
            not interpret,  # SHUFFLE_LUT: inline PTX, compiled kernels only
            self.packed_dot,  # PACKED_DOT
            config.num_stages if factor_scales else 1,  # LOAD_STAGES
        )  # fmt: skip
        assert len(self.args) == len(KERNEL_PARAMS)
        self.compiled = None  # the compiled kernel, once a call has matched it ...
        self.matched = None  # ... for rows with this (x alignment, x row stride, lora_x alignment, row stride)

    def __call__(self, x2d: torch.Tensor, lora_x2d: Optional[torch.Tensor], scaling: float) -> torch.Tensor:
        """The ``(m, n)`` output for ``(m, k)`` rows ``x2d`` (unit stride along K); ``lora_x2d=None``: LoRA reads
        ``x2d``."""
        m, device = self.m, self.device
        out = torch.empty((m, self.n), dtype=self.dtype, device=device)
        if m == 0:
            return out
        if self.packed_dot and (x2d.data_ptr() % 4 or (m > 1 and x2d.stride(0) % 2)):
            x2d = x2d.clone()  # the packed path reads rows as 32-bit pairs; a clone is aligned (K is even here)
        args = list(self.args)
        lx = x2d if lora_x2d is None else lora_x2d
        args[_X], args[_OUT], args[_SCALING], args[_STRIDE_XM] = x2d, out, scaling, x2d.stride(0)
        if self.has_lora:
            args[_LX], args[_STRIDE_LXM] = lx, lx.stride(0)
        else:
            args[_LX] = args[_LORA_A] = args[_LORA_B] = out
            args[_STRIDE_LXM] = 0
        if not self.has_bias:
            args[_BIAS] = out
        # One zeroed int32 buffer (one memset) holds the split-K arrival counters, then the xa chunk counters; the fp32
        # partials have buffers of their own. Unused pointers point at `out`.
        n_partials, n_xa_parts, n_arrivals, n_xa_counts = self.sizes
        if n_arrivals or n_xa_counts:
            counters = torch.zeros(n_arrivals + n_xa_counts, dtype=torch.int32, device=device)
            args[_ARRIVALS] = counters if n_arrivals else out
            args[_XA_COUNT] = (counters[n_arrivals:] if n_arrivals else counters) if n_xa_counts else out
        else:
            args[_ARRIVALS] = args[_XA_COUNT] = out
        args[_PARTIAL] = torch.empty(n_partials, dtype=torch.float32, device=device) if n_partials else out
        args[_XA_PART] = torch.empty(n_xa_parts, dtype=torch.float32, device=device) if n_xa_parts else out
        rows = (not x2d.data_ptr() & 15, args[_STRIDE_XM], not lx.data_ptr() & 15, args[_STRIDE_LXM])
        if self.compiled is not None and rows == self.matched and launch_is_direct(device):
            run_compiled(self.compiled, self.grid, args, device.index)
        else:
            compiled = launch(_fused_small_m_kernel, self.grid, tuple(args), device, **self.options)
            if compiled is not None:
                self.compiled, self.matched = compiled, rows
        return out


def small_m_linear_tiled(
    x2d: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_x2d: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    config: SmallMConfig,
) -> torch.Tensor:
    """Runs the kernel on (M, K) rows with an explicit tiling; returns (M, N) in ``x2d.dtype``.

    ``x2d`` and ``lora_x2d`` (the LoRA branch's rows, ``x2d`` itself when there is no separate one) have unit stride
    along K; ``bias``, ``lora_a`` and ``lora_b`` are contiguous, and ``lora_a``/``lora_b`` both given or both ``None``.
    """
    prepared = SmallMLaunch(x2d.shape[0], x2d.dtype, weight, bias, lora_a, lora_b, config)
    return prepared(x2d, None if lora_x2d is x2d else lora_x2d, float(scaling))


def _unit_stride_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` as (rows, k) with unit stride along k (a view when it already is)."""
    rows = t.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.is_contiguous() else t.contiguous()


def prepare_small_m_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
) -> Optional[Callable[[torch.Tensor, float], torch.Tensor]]:
    """``run(x, scaling)`` = ``small_m_linear(x, weight, bias, lora_a, lora_b, scaling, None)`` for inputs of ``x``'s
    shape and dtype, with the tiling and arguments prepared once ([`SmallMLaunch`]); None when ``bias``, ``lora_a``
    or ``lora_b`` is not contiguous (the call would then read a copy, and in-place updates of the tensor would not
    reach a prepared launch)."""
    if any(t is not None and not t.is_contiguous() for t in (bias, lora_a, lora_b)):
        return None
    n, k = weight.shape
    m = x.numel() // k
    config = pick_config(m, n, k, x.device, weight_kind(weight))
    prepared = SmallMLaunch(m, x.dtype, weight, bias, lora_a, lora_b, config)

    def run(x: torch.Tensor, scaling: float) -> torch.Tensor:
        return prepared(_unit_stride_rows(x, k), None, float(scaling)).view(*x.shape[:-1], n)

    return run


def small_m_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: Optional[torch.Tensor],
    lora_a: Optional[torch.Tensor],
    lora_b: Optional[torch.Tensor],
    scaling: float,
    lora_x: Optional[torch.Tensor],
) -> torch.Tensor:
    """``y = x @ dequant(W).T (+ bias) + scaling * (lora_x @ A.T) @ B.T`` for few rows, in ``x.dtype``.

    Reads the quantized weight once and never materializes it; meant for ``x`` with at most about ``SMALL_M_MAX``
    rows (any M is correct, but the weight is re-read for every 16 rows). Arguments are those of
    [`~peft_fastlora.ops.fastlora_linear`], checked there; ``lora_x=None`` means the LoRA branch reads ``x``.
    """
    n, k = weight.shape
    x2d = _unit_stride_rows(x, k)
    lx2d = None
    if lora_a is not None:
        lx2d = x2d if lora_x is None else _unit_stride_rows(lora_x, k)
    config = pick_config(x2d.shape[0], n, k, x.device, weight_kind(weight))
    out = small_m_linear_tiled(x2d, weight, _contiguous(bias), lx2d, _contiguous(lora_a), _contiguous(lora_b),
                               scaling, config)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
