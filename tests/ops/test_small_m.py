"""``ops/kernels/small_m.py``: the fused small-M quantized linear + LoRA kernel vs ``lora_linear_ref`` (and vs an
fp64 oracle).

Two checks per result:

* against ``lora_linear_ref`` with a per-dtype ``(atol, rtol)``. Inputs are scaled so outputs are O(1). The reference
  rounds twice in ``x.dtype`` (``x @ W.T + bias``, then ``+ LoRA``) and rounds the LoRA term to the adapter dtype; the
  kernel keeps everything in fp32 and rounds once. Each rounding is <= 1/2 ulp of the value it rounds, so where the
  terms cancel (a result near 0 from terms of size ~1) the two differ by ulps of the *terms*, not of the result:
  ``check`` then allows the sum of those roundings, computed element by element from the terms' magnitudes.
* against the exact fp64 value of the same math (W dequantized to ``x.dtype``): the kernel must be within one
  rounding (unit roundoff ``u`` of ``x.dtype``) plus a worst-case fp32 accumulation bound. This proves the kernel
  rounds once and that W is rounded to ``x.dtype`` exactly as the reference does.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peft_fastlora.ops.kernels.tuning import SmallMConfig
from peft_fastlora.ops.quant_state import Packed4bit
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

from .helpers import DEVICE, make_inputs, make_weight

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)
from peft_fastlora.ops.kernels.launch import is_interpreted  # noqa: E402
from peft_fastlora.ops.kernels.small_m import (  # noqa: E402
    XA_MAX_CHUNKS,
    packs_dot,
    pick_config,
    small_m_linear,
    small_m_linear_tiled,
    weight_kind,
    xa_chunking,
)
from peft_fastlora.ops.kernels.small_m_kernel import _fused_small_m_kernel  # noqa: E402

TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def inputs(lead, n, k, dtype, **options):
    """``make_inputs`` with a separate LoRA input unless ``lora_x=False``."""
    return make_inputs(lead, n, k, dtype, **{"lora_x": True, **options})


def factored(weight, config: SmallMConfig) -> bool:
    """Whether the kernel sums code * x per absmax block and scales once (M = 1 FMA path, rows of whole blocks)."""
    aligned = isinstance(weight, Packed4bit) and weight.shape[1] % weight.blocksize == 0
    return aligned and config.factor_scales and not config.use_dot


def check(y, x, weight, bias, lora_a, lora_b, scaling, lora_x, atol, rtol, factored_scales=None, packed_dot=None):
    """Asserts ``y`` against ``lora_linear_ref`` (roundings bounded term by term) and against the exact fp64 value.

    ``atol``/``rtol`` (per dtype, from ``TOLERANCES``) bound the comparison where the terms do not cancel. Where they
    do (a result near 0 made of terms of size ~1), the reference's intermediate roundings dominate: it rounds
    ``x @ W.T + bias`` to ``x.dtype`` (<= u * |base|), computes the LoRA term in the adapter dtype (xa, the product and
    the scaling each round: <= 3 u_a * |s| |xa| @ |B|.T) and casts it (<= u * |lora|), then rounds the sum; the
    kernel rounds once. So the allowed error is ``atol + rtol * |expected|`` or that sum of roundings (each u * the
    magnitude of the term it rounds) plus the fp32 accumulation bound of both sides, whichever is larger.

    ``packed_dot`` (bf16 rows): the kernel rounds each code to bf16 (<= u * |x| @ |W|.T) and sums each word's
    products in bf16, 4 to a half-word, rounding after each (<= 4 u * |x| @ |W|.T): 5 u * that magnitude more, in both
    comparisons.
    """
    n = weight.shape[0]
    assert y.shape == (*x.shape[:-1], n) and y.dtype == x.dtype and y.device == x.device
    expected = lora_linear_ref(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    if factored_scales is None:  # what the default tiling does (a tuning table may also pack)
        rows = x.numel() // x.shape[-1]
        config = pick_config(rows, n, x.shape[-1], x.device, weight_kind(weight))
        factored_scales = factored(weight, config)
        if packed_dot is None:
            packed_dot = packs_dot(config, x.dtype, factored_scales, is_interpreted(_fused_small_m_kernel))
    packed_dot = bool(packed_dot)  # a caller that names its tiling says whether it packs

    # fp64 oracle of the kernel's math: W and bias rounded to x.dtype, xa = lora_x @ A.T in the adapter dtype. With
    # factored scales the kernel never rounds W: the oracle uses the fp32 W, and the reference's rounding of W
    # (<= u * |x| @ |W|.T) is one more allowed difference from the reference.
    w = dequantize_ref(weight, torch.float32 if factored_scales else x.dtype).double()
    x64 = x.double().reshape(-1, x.shape[-1])
    exact, magnitude = x64 @ w.T, x64.abs() @ w.abs().T
    w_rounding = UNIT_ROUNDOFF[x.dtype] * magnitude if factored_scales else 0.0
    if bias is not None:
        exact, magnitude = exact + bias.to(x.dtype).double(), magnitude + bias.to(x.dtype).double().abs()
    base_abs = exact.abs()  # |x @ W.T + bias|: what the reference rounds first
    lora_mag = torch.zeros_like(exact)
    u_a = 0.0
    if lora_a is not None:
        lx = (x if lora_x is None else lora_x).reshape(-1, x.shape[-1])
        xa = F.linear(lx.to(lora_a.dtype), lora_a).double()
        b64 = lora_b.to(lora_a.dtype).double()
        exact = exact + scaling * (xa @ b64.T)
        lora_mag = abs(scaling) * (xa.abs() @ b64.abs().T)
        magnitude = magnitude + lora_mag
        u_a = UNIT_ROUNDOFF[lora_a.dtype]
    u = UNIT_ROUNDOFF[x.dtype]
    accumulation = (x.shape[-1] + lora_a.shape[0] + 2 if lora_a is not None else x.shape[-1] + 1) * 2.0**-24
    accumulation = (1 + u) * accumulation * magnitude

    exp64, y64 = expected.double().reshape(exact.shape), y.double().reshape(exact.shape)
    packed = 5 * u * (x64.abs() @ w.abs().T) if packed_dot else 0.0
    roundings = (u * (base_abs + exp64.abs() + y64.abs()) + (3 * u_a + u) * lora_mag + 2 * accumulation + w_rounding
                 + packed)  # fmt: skip
    allowed = torch.maximum(atol + rtol * exp64.abs(), roundings)
    excess = (y64 - exp64).abs() - allowed
    worst = [int(i) for i in torch.unravel_index(excess.argmax(), excess.shape)]
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {excess.numel()} elements differ from lora_linear_ref by more than the "
        f"reference's roundings allow; worst excess {excess.max().item():.3g} at {worst}"
    )

    bound = u * exact.abs() + accumulation + packed + 1e-30
    error = (y64 - exact).abs()
    assert (error <= bound).all(), f"not within one rounding of the exact result: max excess {(error - bound).max()}"


@pytest.fixture(autouse=True)
def _exact_reference_matmuls():
    """cuBLAS may round fp16/bf16 split-K partial sums to 16 bits; keep the reference at its best on GPU."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


N, K = 40, 192  # K < BLOCK_K of the default tiling, so the K tail is masked
LEADS = {1: (1,), 3: (3,), 16: (2, 8)}  # M = 16 as a 3-D input


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("kind", ["nf4-64-nested", "fp4-128", "int8"])
def test_matches_reference(kind, m, dtype, atol, rtol):
    weight = make_weight(kind, N, K)
    x, bias, a, b, lx = inputs(LEADS[m], N, K, dtype)
    y = small_m_linear(x, weight, bias, a, b, 0.5, lx)
    check(y, x, weight, bias, a, b, 0.5, lx, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=str)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("shape,kind", [((24, 33), "fp4-64"), ((33, 70), "nf4-64-nested")], ids=str)
def test_4bit_rows_not_made_of_whole_blocks(shape, kind, m, dtype, atol, rtol):
    """Odd K and K % blocksize != 0: rows start mid-byte or mid-block (the per-element path)."""
    n, k = shape
    weight = make_weight(kind, n, k)
    x, bias, a, b, lx = inputs((m,), n, k, dtype)
    check(small_m_linear(x, weight, bias, a, b, 2.0, lx), x, weight, bias, a, b, 2.0, lx, atol, rtol)


OPTIONS = {
    "no-bias": dict(bias=False),
    "no-lora": dict(lora=False),
    "nothing": dict(bias=False, lora=False),
    "lora-on-x": dict(lora_x=False),
    "fp32-adapter": dict(adapter_dtype=torch.float32),
    "fp32-bias-r16": dict(bias_dtype=torch.float32, r=16),
}


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[1:], ids=str)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_optional_terms(option, m, dtype, atol, rtol):
    weight = make_weight("nf4-64-nested", N, K)
    x, bias, a, b, lx = inputs((m,), N, K, dtype, **OPTIONS[option])
    y = small_m_linear(x, weight, bias, a, b, 0.25, lx)
    check(y, x, weight, bias, a, b, 0.25, lx, atol, rtol)


TILINGS = [
    # FMA path over 3 rows, several K iterations, split in 3 (last split shorter), blocksize > BLOCK_K
    ("nf4-128-nested", 3, SmallMConfig(use_dot=False, block_n=16, block_k=64, split_k=3)),
    # tensor-core path, 20 rows = two M tiles, split in 2
    ("fp4-64", 20, SmallMConfig(use_dot=True, block_n=16, block_k=64, split_k=2)),
    ("int8", 2, SmallMConfig(use_dot=True, block_n=32, block_k=64, split_k=2)),
    ("int8", 1, SmallMConfig(use_dot=False, block_n=16, block_k=128, split_k=2)),
    # M = 1 over rows of whole blocks: scales factored out (the default) or applied per weight, split in 2
    ("nf4-64-nested", 1, SmallMConfig(use_dot=False, block_n=8, block_k=64, split_k=2)),
    # ... factored with blocksize > BLOCK_K (one sub-block per tile), 3 splits, last one shorter
    ("nf4-128-nested", 1, SmallMConfig(use_dot=False, block_n=16, block_k=64, split_k=3)),
    ("nf4-64-nested", 1, SmallMConfig(use_dot=False, block_n=8, block_k=128, split_k=1, factor_scales=False)),
    ("fp4-64", 1, SmallMConfig(use_dot=False, block_n=16, block_k=32)),
    # ... factored, tiles staged by Triton's pipeliner (num_stages > 1) instead of prefetched in registers
    ("nf4-64-nested", 1, SmallMConfig(use_dot=False, block_n=8, block_k=64, split_k=2, num_stages=3)),
    ("nf4-128-nested", 1, SmallMConfig(use_dot=False, block_n=16, block_k=64, split_k=3, num_stages=4)),
    # tensor-core programs of 32 / 64 rows: 20 rows in one (part-empty) tile, 40 rows in two, 33 in one
    ("nf4-64-nested", 20, SmallMConfig(use_dot=True, block_n=16, block_k=64, split_k=2, block_m=32)),
    ("int8", 40, SmallMConfig(use_dot=True, block_n=16, block_k=64, block_m=32)),
    ("fp4-64", 33, SmallMConfig(use_dot=True, block_n=32, block_k=64, split_k=2, block_m=64)),
]


@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[0], TOLERANCES[2]], ids=str)
@pytest.mark.parametrize("kind,m,config", TILINGS, ids=str)
def test_tilings_and_split_k(kind, m, config, dtype, atol, rtol):
    weight = make_weight(kind, N, K)
    x, bias, a, b, lx = inputs((m,), N, K, dtype)
    y = small_m_linear_tiled(x, weight, bias, lx, a, b, 0.5, config)
    check(y, x, weight, bias, a, b, 0.5, lx, atol, rtol, factored_scales=factored(weight, config))
    again = small_m_linear_tiled(x, weight, bias, lx, a, b, 0.5, config)
    assert torch.equal(y, again), "split-K reduction is not deterministic"


def test_block_m_sets_rows_per_program():
    """A tensor-core program covers ``block_m`` rows (the weight is decoded once per program and M tile)."""
    from peft_fastlora.ops.kernels.small_m import small_m_grid

    for block_m, m, tiles in ((16, 40, 3), (32, 40, 2), (64, 40, 1), (32, 32, 1)):
        plan = small_m_grid(m, 4096, 4096, SmallMConfig(True, 64, 128, 2, block_m=block_m), 16)
        assert (plan.grid[2], plan.block_m) == (tiles, block_m)
        assert plan.n_xa_parts == tiles * XA_MAX_CHUNKS * 16 * block_m
    assert small_m_grid(1, 4096, 4096, SmallMConfig(False, 8, 512, block_m=64), 16).block_m == 1


XA_CASES = [
    # (kind, rows, tiling): K = 640 gives 5 xa chunks of 128 (K % 128 != 0 would end in a short chunk: see 700)
    ("nf4-64-nested", 1, SmallMConfig(use_dot=False, block_n=16, block_k=128, split_k=1)),
    ("nf4-64-nested", 1, SmallMConfig(use_dot=False, block_n=8, block_k=64, split_k=3)),
    ("int8", 3, SmallMConfig(use_dot=True, block_n=16, block_k=64, split_k=2)),
    ("fp4-64", 20, SmallMConfig(use_dot=True, block_n=32, block_k=128, split_k=1)),
    ("nf4-64-nested", 24, SmallMConfig(use_dot=True, block_n=16, block_k=64, split_k=2, block_m=32)),
]


@pytest.mark.parametrize("k", [640, 700])
@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[0], TOLERANCES[1]], ids=str)
@pytest.mark.parametrize("kind,m,config", XA_CASES, ids=str)
def test_lora_down_projection_in_chunks(kind, m, config, dtype, atol, rtol, k):
    """xa = x_lora @ A.T is made in K chunks by the first programs; an epilogue that finds the chunk count incomplete
    makes them itself (the interpreter runs programs one by one, so both happen in one launch). Either way: right and
    the same bits on every call."""
    if kind.startswith("fp4") and k % 64:
        pytest.skip("fp4-64 rows of whole blocks only here")
    weight = make_weight(kind, N, k)
    x, bias, a, b, lx = inputs((m,), N, k, dtype, r=12, adapter_dtype=torch.float32 if m == 3 else None)
    grid_n = -(-N // config.block_n)
    assert xa_chunking(k, grid_n * config.split_k)[2] > 1  # several chunks, so the ordering matters
    y = small_m_linear_tiled(x, weight, bias, lx, a, b, 0.75, config)
    check(y, x, weight, bias, a, b, 0.75, lx, atol, rtol, factored_scales=factored(weight, config))
    assert torch.equal(y, small_m_linear_tiled(x, weight, bias, lx, a, b, 0.75, config))


def test_heuristic_tiles_any_row_count_on_a_gpu(monkeypatch):
    """The heuristic's GPU branch (SM count stubbed, no GPU needed): zero rows (an empty batch reaches pick_config
    before the launcher returns early) must not divide by zero; the M = 1 4-bit tile is one warp."""
    from peft_fastlora.ops.kernels import small_m

    monkeypatch.setattr(small_m, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for m in (0, 1, 5, 40):
        config = small_m.heuristic_config(m, 40, 192, cuda)
        assert config.split_k >= 1 and config.use_dot == (m > 1)
    assert small_m.heuristic_config(1, 4096, 4096, cuda).num_warps == 1
    assert small_m.heuristic_config(1, 4096, 4096, cuda, "int8").num_warps == 4


@pytest.mark.parametrize("n,k,split", [(4096, 4096, 8), (4096, 14336, 7), (14336, 4096, 2), (2048, 8192, 16),
                                       (8192, 3072, 3), (3072, 8192, 8)])  # fmt: skip
def test_heuristic_one_row_splits_k_into_whole_tiles_nearest_the_target(monkeypatch, n, k, split):
    """One row: the split K runs as whole 512-wide tiles per split; of rounding the tiles per split up or down, the
    program count nearest ~24 per SM wins: 7 wanted splits of 4096x4096's 8 tiles become 8 of one tile (what the H100
    table has), not 4 of two; 8192x3072 keeps 3 splits of two tiles rather than 6 of one."""
    from peft_fastlora.ops.kernels import small_m

    monkeypatch.setattr(small_m, "_sm_count", lambda index: 132)
    config = small_m.heuristic_config(1, n, k, torch.device("cuda", 0))
    assert config.split_k == split
    assert small_m.small_m_grid(1, n, k, config, None).split_k == split  # what the launch runs


@pytest.mark.parametrize("m,block_m", [(2, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (96, 64)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (8192, 2048), (256, 1536), (40, 192)])
def test_heuristic_decodes_each_weight_tile_once_up_to_64_rows(monkeypatch, m, block_m, n, k):
    """Past one row: 64 x 128 tiles in programs of the fewest of 16 / 32 / 64 rows holding ``m`` (what the H100 tuning
    chose on every tabled shape), K split towards ~6 programs per SM (16 rows) or ~4 (more), never past the K tiles."""
    from peft_fastlora.ops.kernels import small_m

    monkeypatch.setattr(small_m, "_sm_count", lambda index: 132)
    config = small_m.heuristic_config(m, n, k, torch.device("cuda", 0))
    assert config.use_dot and config.rows_per_program == block_m and config.num_warps == 4
    assert (config.block_n, config.block_k) == (64, min(128, 1 << (k - 1).bit_length()))
    k_tiles = -(-k // config.block_k)
    programs = -(-n // 64) * -(-m // block_m) * config.split_k
    target = 132 * (6 if block_m == 16 else 4)
    assert 1 <= config.split_k <= min(k_tiles, 16)
    assert config.split_k in (k_tiles, 16) or target <= programs < target + -(-n // 64) * -(-m // block_m)


def test_xa_chunking_never_needs_more_programs_than_there_are():
    for k in (16, 33, 192, 640, 4096, 14336, 14337):
        for programs in (1, 2, 3, 7, 16, 1024):
            block, chunk, n_chunks = xa_chunking(k, programs)
            assert chunk % block == 0 and n_chunks * chunk >= k > (n_chunks - 1) * chunk
            assert n_chunks <= min(programs, XA_MAX_CHUNKS), (k, programs, n_chunks)


@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[0], TOLERANCES[2]], ids=str)
def test_factored_path_falls_back_when_codes_are_not_word_aligned(dtype, atol, rtol):
    """The factored M = 1 path reads the codes as int32 words; codes starting at an odd byte take the per-weight path
    (the same bits as asking for it), never a misaligned word load."""
    weight = make_weight("nf4-64-nested", N, K)
    storage = torch.zeros(weight.data.numel() + 1, dtype=torch.uint8, device=DEVICE)
    storage[1:].copy_(weight.data.reshape(-1).view(torch.uint8))
    shifted = dataclasses.replace(weight, data=storage[1:])
    assert shifted.data.data_ptr() % 4 == 1
    config = SmallMConfig(use_dot=False, block_n=8, block_k=64, split_k=2)
    x, bias, a, b, lx = inputs((1,), N, K, dtype)
    y = small_m_linear_tiled(x, shifted, bias, lx, a, b, 0.5, config)
    per_weight = dataclasses.replace(config, factor_scales=False)
    assert torch.equal(y, small_m_linear_tiled(x, weight, bias, lx, a, b, 0.5, per_weight))
    check(y, x, weight, bias, a, b, 0.5, lx, atol, rtol, factored_scales=False)


def test_no_rows_and_strided_rows():
    weight = make_weight("nf4-64-nested", N, K)
    assert small_m_linear(torch.empty(0, K, device=DEVICE), weight, None, None, None, 1.0, None).shape == (0, N)
    x = torch.randn(2, 2 * K, device=DEVICE)[:, :K]  # row stride 2K
    y = small_m_linear(x, weight, None, None, None, 1.0, None)
    torch.testing.assert_close(y, lora_linear_ref(x, weight, None, None, None, 1.0), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------- GPU only

REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out_features, in_features)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("kind", ["nf4-64-nested", "int8"])
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=str)
def test_gpu_real_shapes(shape, kind, m, dtype, atol, rtol):
    n, k = shape
    weight = make_weight(kind, n, k)
    x, bias, a, b, lx = inputs((1, m), n, k, dtype, r=16)
    y = small_m_linear(x, weight, bias, a, b, 2.0, lx)
    check(y, x, weight, bias, a, b, 2.0, lx, atol, rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_cuda_graph_capture_and_replay(m):
    n, k = 4096, 4096
    weight = make_weight("nf4-64-nested", n, k)
    x, bias, a, b, _ = inputs((m,), n, k, torch.bfloat16, r=16)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        small_m_linear(static_x, weight, bias, a, b, 2.0, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = small_m_linear(static_x, weight, bias, a, b, 2.0, None)
    for _ in range(3):
        new_x = torch.randn_like(x)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, small_m_linear(new_x, weight, bias, a, b, 2.0, None))
        check(static_y, new_x, weight, bias, a, b, 2.0, None, *TOLERANCES[2][1:])


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SmallMConfig(False, 8, 512, 8), SmallMConfig(True, 16, 256, 16)], ids=str)
def test_gpu_split_k_is_deterministic(config):
    """The last program of a tile sums the partials in split order: results never vary from run to run."""
    n, k = 4096, 14336
    weight = make_weight("nf4-64-nested", n, k)
    m = 1 if not config.use_dot else 16
    x, bias, a, b, _ = inputs((m,), n, k, torch.bfloat16, r=16)
    first = small_m_linear_tiled(x, weight, bias, x, a, b, 2.0, config)
    check(first, x, weight, bias, a, b, 2.0, None, *TOLERANCES[2][1:], factored_scales=factored(weight, config))
    for _ in range(50):
        assert torch.equal(small_m_linear_tiled(x, weight, bias, x, a, b, 2.0, config), first)


def test_check_still_fails_on_a_real_error():
    """The cancellation-aware bound must not hide an error of a few ulps of the result."""
    weight = make_weight("nf4-64-nested", N, K)
    x, bias, a, b, lx = inputs((3,), N, K, torch.bfloat16)
    y = small_m_linear(x, weight, bias, a, b, 0.5, lx)
    check(y, x, weight, bias, a, b, 0.5, lx, *TOLERANCES[2][1:])
    bad = y.clone()
    bad[1, 7] += 0.125 + 0.125 * bad[1, 7].abs()  # ~16 ulp of an O(1) bf16 value
    with pytest.raises(AssertionError, match="differ from lora_linear_ref"):
        check(bad, x, weight, bias, a, b, 0.5, lx, *TOLERANCES[2][1:])


@pytest.mark.slow
def test_compiled_4bit_paths_look_codes_up_by_shuffle():
    """Compiled for sm_90 ahead of time (no GPU; a subprocess, since the interpreter's kernels cannot be compiled):
    every 4-bit weight the M = 1 and the tensor-core paths decode is one 16-lane shuffle (8 x 512 on one warp: 128 per
    thread; 64 x 128 on 4 warps: 64), the gather variant and int8 have none and read no lane id."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_sm90_ptx.py"))], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["4bit-m1"] == {"code_shuffles": 128, "laneid": 1}
    assert counts["4bit-dot"] == {"code_shuffles": 64, "laneid": 1}
    assert counts["4bit-dot-gather"] == counts["int8-dot"] == {"code_shuffles": 0, "laneid": 0}
