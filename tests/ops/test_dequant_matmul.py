"""The dequant-in-the-matmul kernels (``y = x @ dequant(W).T + b`` and ``dx = g @ dequant(W)``) vs torch.

Two checks per result:

* against torch's matmul of the reference dequantization (``lora_linear_ref`` for the forward,
  ``g @ dequantize_ref(W, g.dtype)`` for dx) within a per-dtype ``(atol, rtol)``; inputs are scaled so results are O(1);
* against the exact fp64 value of the same math (W rounded to the activation dtype): within one rounding plus the
  worst-case fp32 accumulation error. This proves W is decoded and rounded exactly like the reference and that the
  kernel rounds once.

On CPU the kernel runs under the Triton interpreter, so shapes are tiny; GPU tests (``-m gpu``) use Llama shapes.
"""

import dataclasses
import math

import bitsandbytes.functional as bnbF
import pytest
import torch

from peft_fastlora.bnb_weights import packed4bit_from_bnb
from peft_fastlora.ops.dequant_matmul import DequantMatmulConfig, dequant_matmul, dequant_matmul_t, pick_config
from peft_fastlora.ops.quant_state import Int8Rowwise
from peft_fastlora.ops.reference import dequantize_ref, lora_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
STORAGE = {"u8": torch.uint8, "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def make_weight(kind: str, n: int, k: int):
    """``kind``: "int8" or "<nf4|fp4>-<blocksize>[-nested][-<storage: u8|bf16|f16|f32>]".

    bitsandbytes quantizes with blocksizes 32..4096 only; smaller ones get random codes and scales (any such pair is
    a valid weight: the reference decodes it all the same).
    """
    w = torch.randn(n, k, device=DEVICE)
    if kind.startswith(("nf4-8", "fp4-8", "nf4-16", "fp4-16")):
        blocksize = int(kind.split("-")[1])
        weight = make_weight(kind.replace(f"-{blocksize}", "-32", 1), 1, 32)
        n_blocks = math.ceil(n * k / blocksize)
        data = torch.randint(0, 256, ((n * k + 1) // 2,), dtype=torch.uint8, device=DEVICE)
        return dataclasses.replace(weight, data=data, absmax=torch.rand(n_blocks, device=DEVICE) + 0.5,
                                   blocksize=blocksize, shape=(n, k))  # fmt: skip
    if kind == "int8":
        cb, scb, _ = bnbF.int8_vectorwise_quant(w.half())
        return Int8Rowwise(cb=cb, scb=scb)
    quant_type, blocksize, *rest = kind.split("-")
    storage = STORAGE[rest[-1]] if rest and rest[-1] in STORAGE else torch.uint8
    q, st = bnbF.quantize_4bit(
        w, blocksize=int(blocksize), quant_type=quant_type, compress_statistics="nested" in rest, quant_storage=storage
    )
    return packed4bit_from_bnb(q, st)


def rand(*shape, dtype):
    """O(1)-sized dot products: rows of unit norm on average."""
    return (torch.randn(*shape, device=DEVICE) / math.sqrt(shape[-1])).to(dtype)


def check(out, a, b, bias, expected, atol, rtol):
    """Asserts ``out == a @ b (+ bias)`` (``b`` already dequantized to ``a.dtype``), see the module docstring."""
    assert out.shape == expected.shape and out.dtype == a.dtype and out.device == a.device
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double()
    exact, magnitude = a64 @ b64, a64.abs() @ b64.abs()
    if bias is not None:
        exact, magnitude = exact + bias.to(a.dtype).double(), magnitude + bias.to(a.dtype).double().abs()
    u = UNIT_ROUNDOFF[a.dtype]
    accumulation = (1 + u) * (a.shape[-1] + 1) * 2.0**-24 * magnitude
    error = (out.double().reshape(exact.shape) - exact).abs()
    bound = u * exact.abs() + accumulation + 1e-30
    assert (error <= bound).all(), f"not within one rounding of the exact result: max excess {(error - bound).max()}"
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def check_forward(x, weight, bias, atol, rtol, config=None):
    y = dequant_matmul(x, weight, bias, config)
    check(y, x, dequantize_ref(weight, x.dtype).T, bias, lora_linear_ref(x, weight, bias, None, None, 1.0), atol, rtol)


def check_dx(g, weight, atol, rtol, config=None):
    dx = dequant_matmul_t(g, weight, config)
    w = dequantize_ref(weight, g.dtype)
    check(dx, g, w, None, g @ w, atol, rtol)


N, K = 40, 192  # N not a power of two; K = 3 blocks of 64, not a multiple of the interpreter's BLOCK_K (128)
LEADS = {1: (1,), 37: (37,), 24: (2, 3, 4)}  # M = 24 as a 3-D input
KINDS = ["nf4-64-nested", "fp4-128", "nf4-32-nested-bf16", "fp4-64-f32", "int8"]


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=str)
@pytest.mark.parametrize("m", list(LEADS))
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_reference(kind, m, dtype, atol, rtol):
    weight = make_weight(kind, N, K)
    bias = torch.randn(N, device=DEVICE).to(dtype) if m != 1 else None
    check_forward(rand(*LEADS[m], K, dtype=dtype), weight, bias, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=str)
@pytest.mark.parametrize("m", [1, 24])
@pytest.mark.parametrize("kind", KINDS)
def test_dx_matches_reference(kind, m, dtype, atol, rtol):
    weight = make_weight(kind, N, K)
    check_dx(rand(*LEADS[m], N, dtype=dtype), weight, atol, rtol)


TILINGS = [
    # several M tiles in GROUP_M groups, N in 3 tiles (last one partial), BLOCK_K < blocksize (one scale per tile row)
    ("nf4-64-nested", DequantMatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2, swap_ab=True)),
    ("fp4-32", DequantMatmulConfig(block_m=16, block_n=16, block_k=128, group_m=1, swap_ab=False)),  # 4 scales/row
    ("int8", DequantMatmulConfig(block_m=32, block_n=32, block_k=64, group_m=4, swap_ab=False)),
]


@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[1], TOLERANCES[2]], ids=str)
@pytest.mark.parametrize("kind,config", TILINGS, ids=str)
def test_tilings(kind, config, dtype, atol, rtol):
    """Explicit tilings: both MMA orientations, grouped ordering, sub-block scales, tails in every dimension."""
    weight = make_weight(kind, N, K)
    check_forward(rand(50, K, dtype=dtype), weight, torch.randn(N, device=DEVICE), atol, rtol, config)
    check_dx(rand(50, N, dtype=dtype), weight, atol, rtol, config)


@pytest.mark.parametrize("dtype,atol,rtol", [TOLERANCES[0], TOLERANCES[2]], ids=str)
@pytest.mark.parametrize("shape,kind", [((24, 33), "fp4-64"), ((33, 70), "nf4-64-nested"), ((20, 52), "nf4-8")])
def test_4bit_rows_not_made_of_whole_blocks(shape, kind, dtype, atol, rtol):
    """Odd K, K % blocksize != 0 or a blocksize below 16: the per-element path."""
    n, k = shape
    weight = make_weight(kind, n, k)
    check_forward(rand(5, k, dtype=dtype), weight, torch.randn(n, device=DEVICE).to(dtype), atol, rtol)
    check_dx(rand(5, n, dtype=dtype), weight, atol, rtol)


def test_blocksize_16_rows_of_whole_blocks():
    """The smallest blocksize of the (rows, sub-blocks, bytes) path: 8 bytes per scale."""
    weight = make_weight("fp4-16", 24, 80)
    check_forward(rand(5, 80, dtype=torch.float16), weight, None, 2e-3, 2e-3)
    check_dx(rand(5, 24, dtype=torch.float16), weight, 2e-3, 2e-3)


def test_strided_and_empty_inputs():
    weight = make_weight("nf4-64-nested", N, K)
    x = torch.randn(K, 6, device=DEVICE).T / math.sqrt(K)  # column-major (6, K): unit stride along M, not K
    check_forward(x, weight, None, 1e-5, 1e-5)
    g = (torch.randn(3, 2 * N, device=DEVICE) / math.sqrt(N))[:, :N]  # row stride 2N
    check_dx(g, weight, 1e-5, 1e-5)
    assert dequant_matmul(torch.empty(0, K, device=DEVICE), weight).shape == (0, N)
    assert dequant_matmul_t(torch.empty(2, 0, N, device=DEVICE), weight).shape == (2, 0, K)


def test_pick_config():
    assert pick_config(3, N, K, torch.device("cpu")).block_m == 16
    gpu = pick_config(8192, 4096, 4096, torch.device("cuda", 0))
    assert (gpu.block_m, gpu.block_n, gpu.block_k, gpu.swap_ab) == (128, 128, 64, True)
    assert pick_config(40, 4096, 4096, torch.device("cuda", 0)).block_m == 64
    assert pick_config(8192, 4096, 4096, torch.device("cuda", 0), torch.float32).block_n == 64  # no register spills


def test_bad_inputs_raise_clear_errors():
    weight = make_weight("nf4-64-nested", N, K)
    x = rand(2, K, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"`x` must have shape \(\.\.\., 192\)"):
        dequant_matmul(x[:, :-1], weight)
    with pytest.raises(ValueError, match="`x` must have dtype in"):
        dequant_matmul(x.to(torch.int32), weight)
    with pytest.raises(ValueError, match=r"`bias` must have shape \(40,\)"):
        dequant_matmul(x, weight, torch.zeros(N - 1, device=DEVICE))
    with pytest.raises(ValueError, match="`bias` is on meta"):
        dequant_matmul(x, weight, torch.zeros(N, device="meta"))
    with pytest.raises(ValueError, match="`x` is on meta"):
        dequant_matmul(x.to("meta"), weight)
    with pytest.raises(ValueError, match=r"`grad_out` must have shape \(\.\.\., 40\)"):
        dequant_matmul_t(x, weight)
    with pytest.raises(TypeError, match="Packed4bit or Int8Rowwise"):
        dequant_matmul(x, torch.zeros(N, K, device=DEVICE))
    with pytest.raises(ValueError, match="`block_k` must be a power of two, got 48"):
        DequantMatmulConfig(block_k=48)
    with pytest.raises(ValueError, match="`block_m` must be >= 16"):
        DequantMatmulConfig(block_m=8)


# ----------------------------------------------------------------------------------------------------- GPU only

REAL_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out_features, in_features)
GPU_TOLERANCES = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


@pytest.fixture
def _exact_torch_matmuls():
    """cuBLAS may round fp16/bf16 split-K partial sums to 16 bits; keep the reference at its best on GPU."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.gpu
@pytest.mark.usefixtures("_exact_torch_matmuls")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 300, 2048])
@pytest.mark.parametrize("kind", ["nf4-64-nested", "fp4-128", "int8"])
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=str)
def test_gpu_real_shapes(shape, kind, m, dtype):
    n, k = shape
    weight = make_weight(kind, n, k)
    check_forward(rand(1, m, k, dtype=dtype), weight, torch.randn(n, device=DEVICE), *GPU_TOLERANCES[dtype])
    check_dx(rand(1, m, n, dtype=dtype), weight, *GPU_TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.usefixtures("_exact_torch_matmuls")
@pytest.mark.parametrize("lut_asm", [False, True])
@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_gpu_tilings(block_k, swap_ab, lut_asm):
    """Every BLOCK_K around blocksize 64, both MMA orientations and both code-table reads, on a real size."""
    n, k = 1024, 2048
    weight = make_weight("nf4-64-nested", n, k)
    config = DequantMatmulConfig(block_m=128, block_n=128, block_k=block_k, swap_ab=swap_ab, lut_asm=lut_asm)
    for dtype, atol, rtol in TOLERANCES[1:]:
        check_forward(rand(700, k, dtype=dtype), weight, None, atol, rtol, config)
        check_dx(rand(700, n, dtype=dtype), weight, atol, rtol, config)


@pytest.mark.gpu
@pytest.mark.usefixtures("_exact_torch_matmuls")
@pytest.mark.parametrize(
    "shape,kind", [((1024, 2048), "nf4-64-nested"), ((1000, 1000), "nf4-64"), ((768, 1024), "int8")]
)
def test_gpu_fp32_and_odd_layouts(shape, kind):
    """fp32 activations (exact fp32 products) and a 4-bit layout with rows starting mid-block (per-element path)."""
    n, k = shape
    weight = make_weight(kind, n, k)
    for dtype, atol, rtol in TOLERANCES:
        check_forward(rand(300, k, dtype=dtype), weight, torch.randn(n, device=DEVICE), atol, rtol)
        check_dx(rand(300, n, dtype=dtype), weight, atol, rtol)
