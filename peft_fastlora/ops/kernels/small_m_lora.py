"""The LoRA half of the fused small-M kernel (``small_m_kernel.py``): the down-projection ``xa = x_lora @ A.T`` made
in K chunks inside the launch, and the epilogue that adds the bias and ``scaling * xa @ B.T`` and stores the output.

``xa`` (M x r, a few thousand MACs) is made inside the same launch, because a separate matmul would cost a launch of
its own on every decode call. K is cut into at most ``XA_MAX_CHUNKS`` chunks; the first programs of the grid (the
first dispatched) each compute one chunk's fp32 partial of ``xa`` before their own tile ([`store_lora_down_chunk`]),
store it and count it (release). An epilogue waits for the count (acquire) and sums the partials in one fixed order
(deterministic). Correctness never depends on the scheduler: an epilogue that does not see the full count within
``XA_POLLS`` polls (zero under the interpreter, which runs programs one after another) makes the chunks itself with
the same code, so the sum is the same bits either way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import round_to


@triton.jit
def _lora_down_chunk(
    lx_ptr,  # (M, K) LoRA input rows, unit stride along K
    lora_a_ptr,  # (R, K)
    offs_m,
    k_lo,
    k_hi,
    M,
    R,
    stride_lxm,
    stride_an,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
):
    """fp32 partial of xa = x_lora.to(A.dtype) @ A.T over x_lora[:, k_lo : k_hi]: (BLOCK_R, BLOCK_M) for the MMA
    path (xa transposed, as the epilogue's dot takes it), (1, BLOCK_R) for M = 1."""
    a_ty = lora_a_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if USE_DOT:
        part = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    else:
        part = tl.zeros((1, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, XA_BLOCK_K):
        offs_k = k0 + tl.arange(0, XA_BLOCK_K)
        mask_k = offs_k < k_hi
        a = tl.load(lora_a_ptr + offs_r[:, None] * stride_an + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                    other=0.0)  # (BLOCK_R, XA_BLOCK_K)  # fmt: skip
        if USE_DOT:
            x_t = tl.load(lx_ptr + offs_m[None, :] * stride_lxm + offs_k[:, None],
                          mask=mask_k[:, None] & (offs_m < M)[None, :], other=0.0)  # fmt: skip
            x_t = x_t.to(a_ty)  # (XA_BLOCK_K, BLOCK_M), rounded to the adapter dtype like the reference
            if DOT_FP32:
                part = tl.dot(a.to(tl.float32), x_t.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(a, x_t, part)
        else:
            x = tl.load(lx_ptr + offs_m[:, None] * stride_lxm + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            x = x.to(a_ty).to(tl.float32)  # (1, XA_BLOCK_K)
            part += tl.sum(a.to(tl.float32) * x, axis=1)[None, :]
    return part


@triton.jit
def _chunk_tile_offsets(USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Offsets of one chunk partial's elements inside its (BLOCK_R * BLOCK_M) slot of the workspace."""
    if USE_DOT:
        offs = tl.arange(0, BLOCK_R)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        offs = tl.arange(0, BLOCK_R)[None, :]
    return offs


@triton.jit
def _lora_down(
    lx_ptr,
    lora_a_ptr,
    xa_part_ptr,  # (m tiles, XA_MAX_CHUNKS, BLOCK_R * BLOCK_M) fp32 chunk partials
    xa_count_ptr,  # (m tiles, XA_COPIES, XA_COPY_STRIDE) int32 zeros: chunks stored so far, in XA_COPIES copies
    offs_m,
    pid_n,
    pid_m,
    n_chunks,
    xa_chunk,
    M,
    K,
    R,
    stride_lxm,
    stride_an,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
    XA_MAX_CHUNKS: tl.constexpr,
    XA_COPIES: tl.constexpr,
    XA_COPY_STRIDE: tl.constexpr,
    XA_POLLS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """xa = x_lora @ A.T for this program's rows, in the adapter dtype: the chunk partials summed in one fixed order.

    Waits (``XA_POLLS`` polls at most) until the producers have stored every chunk; if they have not, makes every
    chunk here and stores it into the same slots (the same code gives the same bits, so a slot a producer writes
    too holds the same value), then sums as usual. The counter polled is one of ``XA_COPIES`` copies (by tile), so
    that the epilogues of many tiles do not all hit one address.
    """
    count_ptr = xa_count_ptr + (pid_m * XA_COPIES + pid_n % XA_COPIES) * XA_COPY_STRIDE
    done = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (done < n_chunks) & (polls < XA_POLLS):
        done = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    slots = xa_part_ptr + pid_m * (XA_MAX_CHUNKS * BLOCK_R * BLOCK_M)
    offs = _chunk_tile_offsets(USE_DOT, BLOCK_M, BLOCK_R)
    if done < n_chunks:
        for c in range(0, n_chunks):
            k_lo = c * xa_chunk
            part = _lora_down_chunk(lx_ptr, lora_a_ptr, offs_m, k_lo, tl.minimum(k_lo + xa_chunk, K), M, R,
                                    stride_lxm, stride_an, USE_DOT, DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K)  # fmt: skip
            tl.store(slots + c * (BLOCK_R * BLOCK_M) + offs, part)
        tl.debug_barrier()
    # All chunk partials in one load, read from L2 (.cg), not a stale L1 line; missing chunks read as 0.
    chunks = tl.arange(0, XA_MAX_CHUNKS)
    if USE_DOT:
        ptrs = slots + chunks[:, None, None] * (BLOCK_R * BLOCK_M) + offs[None, :, :]
        parts = tl.load(ptrs, mask=(chunks < n_chunks)[:, None, None], other=0.0, cache_modifier=".cg")
        xa = tl.sum(parts, axis=0)  # (BLOCK_R, BLOCK_M)
    else:
        ptrs = slots + chunks[:, None] * (BLOCK_R * BLOCK_M) + tl.arange(0, BLOCK_R)[None, :]
        parts = tl.load(ptrs, mask=(chunks < n_chunks)[:, None], other=0.0, cache_modifier=".cg")
        xa = tl.sum(parts, axis=0)[None, :]  # (1, BLOCK_R)
    return round_to(xa, lora_a_ptr.dtype.element_ty, INTERPRET)


@triton.jit
def epilogue(
    acc,  # (BLOCK_N, BLOCK_M) fp32: (x @ W.T).T for this tile
    offs_n,
    offs_m,
    pid_n,
    pid_m,
    M,
    N,
    K,
    R,
    scaling,
    bias_ptr,
    lx_ptr,
    lora_a_ptr,
    lora_b_ptr,  # (N, R)
    xa_part_ptr,
    xa_count_ptr,
    out_ptr,  # (M, N)
    n_chunks,
    xa_chunk,
    stride_lxm,
    stride_an,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    LORA_DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr,
    XA_MAX_CHUNKS: tl.constexpr,
    XA_COPIES: tl.constexpr,
    XA_COPY_STRIDE: tl.constexpr,
    XA_POLLS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[m, n] = acc + bias (rounded to x.dtype) + scaling * xa[m] @ B[n] (fp32), stored in x.dtype.

    ``xa = x_lora @ A.T`` (adapter dtype) comes from [`_lora_down`]: (BLOCK_R, BLOCK_M) for the MMA path, (1, BLOCK_R)
    for M = 1.
    """
    out_ty = out_ptr.dtype.element_ty
    mask_n = offs_n < N
    mask_m = offs_m < M
    if HAS_LORA:
        xa = _lora_down(lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_n, pid_m, n_chunks, xa_chunk, M,
                        K, R, stride_lxm, stride_an, USE_DOT, LORA_DOT_FP32, BLOCK_M, BLOCK_R, XA_BLOCK_K,
                        XA_MAX_CHUNKS, XA_COPIES, XA_COPY_STRIDE, XA_POLLS, INTERPRET)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += round_to(bias, out_ty, INTERPRET).to(tl.float32)[:, None]
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        b_ptrs = lora_b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :]
        b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
        b = b.to(xa.dtype)  # the reference casts B to the adapter (A) dtype
        if USE_DOT:  # xa: (BLOCK_R, BLOCK_M)
            if LORA_DOT_FP32:
                lora = tl.dot(b.to(tl.float32), xa.to(tl.float32), input_precision="ieee")
            else:
                lora = tl.dot(b, xa)
        else:  # xa: (1, BLOCK_R)
            lora = tl.sum(b.to(tl.float32) * xa.to(tl.float32), axis=1)[:, None]
        acc += lora * scaling
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, round_to(acc, out_ty, INTERPRET), mask=mask_n[:, None] & mask_m[None, :])



@triton.jit
def store_lora_down_chunk(
    lx_ptr, lora_a_ptr, xa_part_ptr, xa_count_ptr, offs_m, pid_m, chunk, xa_chunk, M, K, R, stride_lxm, stride_an,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    XA_BLOCK_K: tl.constexpr, XA_MAX_CHUNKS: tl.constexpr, XA_COPIES: tl.constexpr, XA_COPY_STRIDE: tl.constexpr,
):  # fmt: skip
    """A producer's part: chunk ``chunk``'s fp32 partial of xa, stored in its slot and counted in every counter copy."""
    k_lo = chunk * xa_chunk
    k_hi = tl.minimum(k_lo + xa_chunk, K)
    part = _lora_down_chunk(lx_ptr, lora_a_ptr, offs_m, k_lo, k_hi, M, R, stride_lxm, stride_an, USE_DOT, DOT_FP32,
                            BLOCK_M, BLOCK_R, XA_BLOCK_K)  # fmt: skip
    slot = (pid_m * XA_MAX_CHUNKS + chunk) * (BLOCK_R * BLOCK_M)
    tl.store(xa_part_ptr + slot + _chunk_tile_offsets(USE_DOT, BLOCK_M, BLOCK_R), part)
    # Every thread's store is done before one thread counts the chunk (release, GPU scope), in every copy.
    tl.debug_barrier()
    for copy in tl.static_range(XA_COPIES):
        count_ptr = xa_count_ptr + (pid_m * XA_COPIES + copy) * XA_COPY_STRIDE
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
