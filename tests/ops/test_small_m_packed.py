"""The packed M = 1 path of the fused small-M kernel (``PACKED_DOT``): byte-permute decode and bf16x2 sums.

Its inline PTX cannot run under the interpreter, so the CPU tests check it in two other ways: the table and decode
PTX run on ``tests/ptx_emulator.py`` against bitsandbytes' code tables, and the kernel compiled ahead of time for
sm_90 holds the instructions it should. The GPU tests run it against the reference (``test_small_m.check``, with the
path's roundings in the bound).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from peft_fastlora.ops.kernels.small_m_kernel import PACKED_DOT_PTX, PERMUTE_DECODE_PTX, PERMUTE_TABLE_PTX
from peft_fastlora.ops.kernels.tuning import SmallMConfig
from tests.ptx_emulator import LANES, bf16_bits, run_ptx, word_nibbles

from .helpers import DEVICE, make_inputs, make_weight

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_table_and_decode_give_each_nibble_its_bf16_code(kind):
    """The table PTX builds the same 8 words in every lane from a table held one entry per lane, and the decode PTX
    turns random words into their 8 codes rounded to bf16, element 2 i in the low half of pair i."""
    code = make_weight(kind, 8, 64, "cpu").code.float()
    entry = [_fp32_bits(code[lane % 16].item()) for lane in range(LANES)]
    table = run_ptx(PERMUTE_TABLE_PTX.value, {"$8": entry})
    words = [table[f"${i}"] for i in range(8)]
    assert all(len(set(w)) == 1 for w in words), "every lane must hold the same table"
    bits = [bf16_bits(_fp32_bits(v)) for v in code.tolist()]
    low, high = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    expected = [sum(v[4 * i + j] << (8 * j) for j in range(4)) for v in (low, high) for i in range(4)]
    assert [w[0] for w in words] == expected
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        packed = torch.randint(0, 2**32, (LANES,), generator=gen, dtype=torch.int64).tolist()
        out = run_ptx(PERMUTE_DECODE_PTX.value, {"$4": packed, **{f"${5 + i}": words[i] for i in range(8)}})
        for lane, word in enumerate(packed):
            pairs = [out[f"${i}"][lane] for i in range(4)]
            decoded = [half for p in pairs for half in (p & 0xFFFF, p >> 16)]
            assert decoded == [bits[q] for q in word_nibbles(word)], hex(word)


def _sm90_script_json(script: str):
    """The JSON that ``script`` prints last, run in a subprocess without ``TRITON_INTERPRET`` (the interpreter cannot
    compile ahead of time for sm_90; no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SM90_PACKED = """
import json, sys
sys.path.insert(0, ".")
from tests.ops._sm90_ptx import ptx
counts = {}
for packed in (False, True):
    text = ptx("*i32", "*u8", dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, FACTOR_SCALES=True,
                                   SHUFFLE_LUT=True, PACKED_DOT=packed), 1)
    counts[packed] = {"code_shuffles": text.count("0x101f"), "prmt": text.count("prmt.b32"),
                      "fma_bf16x2": text.count("fma.rn.bf16x2")}
print(json.dumps(counts))
"""


def test_compiled_packed_path_decodes_by_permutes_and_sums_in_bf16x2():
    """Compiled for sm_90 ahead of time (no GPU; a subprocess, as the interpreter cannot compile), 8 x 512 tiles on
    one warp: the packed path has no per-weight code shuffle; each thread's 16 words a step take 14 permutes each
    (plus 8 that build the table once) and 4 bf16x2 FMAs each. The default path looks codes up by shuffle."""
    counts = _sm90_script_json(SM90_PACKED)
    assert counts["true"] == {"code_shuffles": 0, "prmt": 16 * 14 + 8, "fma_bf16x2": 16 * 4}, counts
    assert counts["false"]["code_shuffles"] > 0 and counts["false"]["fma_bf16x2"] == 0, counts


SM90_WORD_LOADS = """
import json, re, sys
sys.path.insert(0, ".")
from tests.ops._sm90_ptx import ptx
widths = {}
for packed in (False, True):
    text = ptx("*i32", "*u8", dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, FACTOR_SCALES=True,
                                   SHUFFLE_LUT=True, PACKED_DOT=packed, HAS_LORA=False, SPLIT_K=1), 1, aligned=True)
    widths[packed] = sorted(set(re.findall(r"ld\\.global\\.(v[24])\\.b32", text)))
print(json.dumps(widths))
"""


def test_compiled_m1_path_loads_words_and_x_as_16_byte_vectors():
    """Specialized as on a real model (aligned pointers, K a multiple of 16), the M = 1 kernel's words and x load
    4 x 32 bits at a time on both paths: with k0 known only as a multiple of 16 and a mask per word, Triton split
    the word loads into 8-byte ones (``_load_words``)."""
    widths = _sm90_script_json(SM90_WORD_LOADS)
    assert widths == {"false": ["v4"], "true": ["v4"]}, widths


def test_packed_dot_ptx_is_four_bf16x2_fmas():
    assert PACKED_DOT_PTX.value.count("fma.rn.bf16x2") == 4


def test_config_field_round_trips():
    config = SmallMConfig(use_dot=False, block_n=8, block_k=512, packed_dot=True)
    assert config.to_json()["packed_dot"] is True
    assert "packed_dot" not in SmallMConfig(use_dot=False, block_n=8, block_k=512).to_json()
    assert SmallMConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="packed_dot"):
        SmallMConfig(use_dot=False, block_n=8, block_k=512, packed_dot="yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("factor_scales", [True, False])
@pytest.mark.parametrize("interpret", [True, False])
def test_packed_path_runs_only_on_compiled_factored_bf16_launches(dtype, factor_scales, interpret):
    from peft_fastlora.ops.kernels.small_m import packs_dot

    asked = SmallMConfig(use_dot=False, block_n=8, block_k=512, packed_dot=True)
    expected = dtype == torch.bfloat16 and factor_scales and not interpret
    assert packs_dot(asked, dtype, factor_scales, interpret) == expected
    assert not packs_dot(dataclasses.replace(asked, packed_dot=False), dtype, factor_scales, interpret)


PACKED_CONFIGS = [
    SmallMConfig(use_dot=False, block_n=8, block_k=512, split_k=1, num_warps=1, packed_dot=True),
    SmallMConfig(use_dot=False, block_n=16, block_k=256, split_k=3, num_warps=2, packed_dot=True),
    SmallMConfig(use_dot=False, block_n=8, block_k=256, split_k=2, num_warps=1, num_stages=3, packed_dot=True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a GPU")
@pytest.mark.parametrize("kind", ["nf4", "nf4-nested", "fp4", "nf4-128"])
@pytest.mark.parametrize("config", PACKED_CONFIGS, ids=str)
@pytest.mark.parametrize("lora", [False, True])
def test_gpu_packed_path_matches_reference(kind, config, lora):
    from peft_fastlora.ops.kernels.small_m import small_m_linear_tiled

    from .test_small_m import TOLERANCES, check

    dtype, atol, rtol = TOLERANCES[2]
    n, k = 200, 1536  # rows past a tile; K of 3 tiles of 512
    weight = make_weight(kind, n, k, DEVICE)
    x, bias, a, b, lx = make_inputs((1,), n, k, dtype, lora_x=False)
    if not lora:
        a = b = None
    y = small_m_linear_tiled(x.reshape(1, k), weight, bias, x.reshape(1, k) if lora else None, a, b, 0.5, config)
    check(y.reshape(1, n), x, weight, bias, a, b, 0.5, None, atol, rtol, factored_scales=True, packed_dot=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a GPU")
def test_gpu_packed_path_reads_misaligned_rows_from_an_aligned_copy():
    from peft_fastlora.ops.kernels.small_m import small_m_linear_tiled

    weight = make_weight("nf4", 64, 512, DEVICE)
    storage = torch.randn(513, device=DEVICE, dtype=torch.bfloat16)
    x = storage[1:].reshape(1, 512)  # 2 bytes off a 4-byte boundary
    assert x.data_ptr() % 4
    y = small_m_linear_tiled(x, weight, None, None, None, None, 1.0, PACKED_CONFIGS[0])
    torch.testing.assert_close(y, small_m_linear_tiled(x.clone(), weight, None, None, None, None, 1.0,
                                                       PACKED_CONFIGS[0]), rtol=0, atol=0)  # fmt: skip
