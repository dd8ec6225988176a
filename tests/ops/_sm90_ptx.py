"""Compiles the fused small-M kernel ahead of time for sm_90 (no GPU needed) and prints, per variant, how many
16-lane code-table shuffles and lane-id reads its PTX holds, as JSON. Run without ``TRITON_INTERPRET`` (under the
interpreter ``@triton.jit`` functions cannot be compiled); ``test_small_m.py`` runs it in a subprocess."""

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from peft_fastlora.ops.kernels.small_m import KERNEL_PARAMS
from peft_fastlora.ops.kernels.small_m_kernel import (
    WEIGHT_4BIT_ALIGNED,
    WEIGHT_INT8,
    _fused_small_m_kernel,
)

POINTERS = {"x_ptr": "*bf16", "code_ptr": "*fp32", "nested_code_ptr": "*fp32", "nested_absmax_ptr": "*fp32",
            "offset_ptr": "*fp32", "bias_ptr": "*bf16", "lx_ptr": "*bf16", "lora_a_ptr": "*bf16",
            "lora_b_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "arrivals_ptr": "*i32",
            "xa_part_ptr": "*fp32", "xa_count_ptr": "*i32"}  # fmt: skip
# (w_ptr, absmax_ptr, constexprs) per variant: M = 1 words, 16-row tensor cores (4-bit with and without the shuffle),
# 16-row tensor cores int8.
VARIANTS = {
    "4bit-m1": ("*i32", "*u8", dict(WEIGHT_KIND=WEIGHT_4BIT_ALIGNED.value, USE_DOT=False, BLOCK_M=1, BLOCK_N=8,
                                    BLOCK_K=512, FACTOR_SCALES=True, SHUFFLE_LUT=True), 1),
    "4bit-dot": ("*u8", "*u8", dict(WEIGHT_KIND=WEIGHT_4BIT_ALIGNED.value, USE_DOT=True, BLOCK_M=16, BLOCK_N=64,
                                    BLOCK_K=128, FACTOR_SCALES=False, SHUFFLE_LUT=True), 4),
    "4bit-dot-gather": ("*u8", "*u8", dict(WEIGHT_KIND=WEIGHT_4BIT_ALIGNED.value, USE_DOT=True, BLOCK_M=16,
                                           BLOCK_N=64, BLOCK_K=128, FACTOR_SCALES=False, SHUFFLE_LUT=False), 4),
    "int8-dot": ("*i8", "*fp32", dict(WEIGHT_KIND=WEIGHT_INT8.value, USE_DOT=True, BLOCK_M=16, BLOCK_N=64,
                                      BLOCK_K=128, FACTOR_SCALES=False, SHUFFLE_LUT=True), 4),
}
COMMON = dict(BLOCKSIZE=64, NESTED=True, NESTED_BLOCKSIZE=256, SUB=64, HAS_BIAS=False, HAS_LORA=True, DOT_FP32=False,
              LORA_DOT_FP32=False, BLOCK_R=16, SPLIT_K=8, XA_BLOCK_K=128, XA_MAX_CHUNKS=16, XA_COPIES=8,
              XA_COPY_STRIDE=32, XA_POLLS=16384, INTERPRET=False, MUL_RN=True, PACKED_DOT=False,
              LOAD_STAGES=1)  # fmt: skip


# What a launch on a real model tells Triton: every pointer 16-byte aligned, and these integers multiples of 16
# (Triton specializes both; the loads' vector widths depend on it).
MULTIPLES_OF_16 = ("N", "K", "stride_xm", "stride_wn", "stride_lxm", "stride_an", "stride_om", "k_per_split",
                   "xa_chunk")  # fmt: skip


def sm90_ptx(fn, signature: dict, constexprs: dict, attrs: dict | None = None, **options) -> str:
    """The PTX of ``@triton.jit`` function ``fn`` compiled for sm_90 with launch ``options`` (``signature``: every
    parameter's type, the constexprs' as ``"constexpr"``; ``attrs``: Triton's specialization attributes by
    parameter index)."""
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def ptx(w_type: str, absmax_type: str, constexprs: dict, num_warps: int, aligned: bool = False) -> str:
    """The fused small-M kernel's PTX; ``aligned``: specialized as a launch on a real model's shapes would be."""
    constexprs = {**COMMON, **constexprs}
    types = {**POINTERS, "w_ptr": w_type, "absmax_ptr": absmax_type}
    signature = {name: types.get(name) or ("constexpr" if name in constexprs else "fp32" if name == "scaling" else
                                           "i32") for name in KERNEL_PARAMS}  # fmt: skip
    attrs = None
    if aligned:
        divisible = [i for i, name in enumerate(KERNEL_PARAMS) if name in MULTIPLES_OF_16 or name.endswith("_ptr")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    return sm90_ptx(_fused_small_m_kernel, signature, constexprs, attrs, num_warps=num_warps)


def main() -> None:
    counts = {}
    for name, (w_type, absmax_type, constexprs, num_warps) in VARIANTS.items():
        text = ptx(w_type, absmax_type, constexprs, num_warps)
        counts[name] = {"code_shuffles": text.count("0x101f"), "laneid": text.count("%laneid")}
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
