"""``ops/kernels/cross_entropy.py`` against its torch twin, the twin against autograd of ``F.cross_entropy``, and
``ops/linear_cross_entropy.py`` (the LM head fused with its loss) against the unfused head + transformers-style loss:
loss and every gradient, many chunks and one, ignored targets, ``num_items_in_batch``, autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peft_fastlora.ops import kernels, linear_cross_entropy
from peft_fastlora.ops.linear_cross_entropy import chunk_rows
from peft_fastlora.ops.reference import cross_entropy_grad_ref

from .helpers import assert_close_scaled

IGNORE = -100
ELEMENTWISE_CASES = [  # (dtype, atol, rtol): fp32 math in both, one rounding of the gradient; exp/log differ by ulps
    pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 8e-3, 8e-3, id="bf16"),
]
LOSS_CASES = [  # (dtype, atol, rtol) against the unfused computation in the same dtype (atol scaled by the largest)
    pytest.param(torch.float32, 1e-5, 1e-4, id="fp32"),
    pytest.param(torch.float16, 4e-3, 4e-3, id="fp16"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
]


def _targets(rows: int, vocab: int, ignored: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[torch.randperm(rows, generator=gen)[:ignored]] = IGNORE
    return target


@pytest.mark.parametrize("rows, vocab, block", [(5, 37, 8192), (9, 1000, 256), (3, 5000, 1024)],
                         ids=["one-block", "4-blocks-ragged", "5-blocks-ragged"])  # fmt: skip
@pytest.mark.parametrize("dtype, atol, rtol", ELEMENTWISE_CASES)
def test_kernel_matches_its_twin(force_triton, monkeypatch, rows, vocab, block, dtype, atol, rtol):
    """Rows of one block and of several, the last one partial (the running max and sum carried across blocks)."""
    monkeypatch.setattr(kernels.load().cross_entropy, "MAX_BLOCK_V", block)
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    target = _targets(rows, vocab, ignored=1)
    expected_grad = logits.clone()
    expected = cross_entropy_grad_ref(expected_grad, target, 0.25, IGNORE)
    got_grad = logits.clone()
    got = kernels.load().cross_entropy.cross_entropy_grad_(got_grad, target, 0.25, IGNORE)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, atol=atol, rtol=rtol)
    assert not torch.equal(got_grad, logits)  # overwritten with the gradient
    assert torch.all(got_grad[target == IGNORE] == 0) and torch.all(got[target == IGNORE] == 0)


def test_kernel_reads_rows_with_a_stride(force_triton):
    """A chunk's logits may be a row slice of a wider buffer: the kernel follows stride(0)."""
    wide = torch.randn(4, 300)
    logits, target = wide[:, :200], _targets(4, 200, ignored=0)
    expected_grad = logits.clone()
    expected = cross_entropy_grad_ref(expected_grad, target, 1.0, IGNORE)
    got = kernels.load().cross_entropy.cross_entropy_grad_(logits, target, 1.0, IGNORE)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(logits, expected_grad)


def test_twin_is_cross_entropy_and_its_gradient():
    logits = torch.randn(11, 53, dtype=torch.float64) * 3
    target = _targets(11, 53)
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=IGNORE, reduction="sum")
    loss.backward()
    grad = logits.clone()
    rows = cross_entropy_grad_ref(grad, target, 1.0, IGNORE)
    torch.testing.assert_close(rows.sum().double(), loss.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=1e-6)


def _unfused(hidden, weight, bias, target, num_items=None):
    """The LM head and transformers' ``ForCausalLMLoss`` arithmetic: logits in the compute dtype, loss in fp32."""
    logits = F.linear(hidden, weight, bias).float()
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1), ignore_index=IGNORE,
                           reduction=reduction)  # fmt: skip
    return loss if num_items is None else loss / num_items


def _leaves(dtype, lead=(2, 13), hidden_size=24, vocab=301, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("chunk_bytes", [3 * 301 * 4, 2**28], ids=["ragged-chunks", "one-chunk"])
@pytest.mark.parametrize("dtype, atol, rtol", LOSS_CASES)
def test_matches_the_unfused_head_and_loss(request, path, chunk_bytes, dtype, atol, rtol):
    request.getfixturevalue("force_triton" if path == "triton" else "reference_path")
    target = _targets(26, 301, ignored=4).reshape(2, 13)
    hidden, weight, bias = _leaves(dtype)
    loss = linear_cross_entropy(hidden, weight, target, bias, chunk_bytes=chunk_bytes)
    loss.backward()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    expected = _unfused(*ref_leaves, target)
    expected.backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol)
    for name, got, ref in zip(("hidden", "weight", "bias"), (hidden, weight, bias), ref_leaves):
        assert got.grad.dtype == dtype, name
        assert_close_scaled(got.grad, ref.grad, atol, rtol, name)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_num_items_in_batch_and_a_frozen_head(request, path):
    """transformers' gradient-accumulation convention (sum / num_items_in_batch), and a frozen head without bias, the
    usual QLoRA case: only the hidden states get a gradient; a scaled upstream gradient scales it."""
    request.getfixturevalue("force_triton" if path == "triton" else "reference_path")
    target = _targets(26, 301).reshape(2, 13)
    hidden, weight, _ = _leaves(torch.float32, bias=False)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, target, num_items_in_batch=torch.tensor(40), chunk_bytes=5 * 301 * 4)
    (loss * 3).backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    expected = _unfused(ref_hidden, weight, None, target, num_items=40)
    (expected * 3).backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-6, rtol=1e-5)
    assert weight.grad is None


def test_autocast_computes_in_the_autocast_dtype(reference_path):
    """Under autocast the head runs in the autocast dtype, as ``nn.Linear`` would; gradients come back in the leaves'
    dtype."""
    target = _targets(26, 301).reshape(2, 13)
    hidden, weight, bias = _leaves(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, target, bias)
    loss.backward()
    expected = _unfused(*(t.detach().to(torch.bfloat16) for t in (hidden, weight, bias)), target)
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-3)
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_chunk_rows_keep_a_chunk_within_the_budget():
    assert chunk_rows(152064, 2) == 882  # 256 MiB of bf16 logits of a 152k vocabulary
    assert chunk_rows(32000, 2) == 4194
    assert chunk_rows(10**9, 4, chunk_bytes=1) == 1


@pytest.mark.parametrize("change, match", [
    (dict(weight=torch.zeros(5, 7)), "`weight` must be"),
    (dict(target=torch.zeros(5, dtype=torch.long)), "`target` must hold"),
    (dict(target=torch.zeros(2, 13)), "integer tensor"),
    (dict(chunk_bytes=0), "`chunk_bytes`"),
], ids=["weight", "target-count", "target-dtype", "chunk"])  # fmt: skip
def test_bad_arguments_name_the_argument(change, match):
    hidden, weight, _ = _leaves(torch.float32, bias=False)
    args = {**dict(hidden=hidden, weight=weight, target=_targets(26, 301).reshape(2, 13)), **change}
    chunk = args.pop("chunk_bytes", 2**20)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_cross_entropy(args["hidden"], args["weight"], args["target"], chunk_bytes=chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab", [(64, 152064), (300, 32000), (7, 50257)], ids=str)
def test_gpu_kernel_matches_its_twin_on_real_vocabularies(rows, vocab):
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
    target = _targets(rows, vocab).cuda()
    expected_grad = logits.clone()
    expected = cross_entropy_grad_ref(expected_grad, target, 0.5, IGNORE)
    got = kernels.load().cross_entropy.cross_entropy_grad_(logits, target, 0.5, IGNORE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits, expected_grad, atol=8e-3, rtol=8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [2**22, 2**28], ids=["many-chunks", "one-chunk"])
def test_gpu_matches_the_unfused_head_and_loss(chunk_bytes):
    """bf16 on CUDA at a Llama-like head (1024 hidden, 32000 vocabulary, 2 x 512 tokens), head and bias frozen and
    trainable."""
    target = _targets(1024, 32000, ignored=100).reshape(2, 512).cuda()
    leaves = [t.detach().cuda().requires_grad_() for t in _leaves(torch.bfloat16, (2, 512), 1024, 32000)]
    loss = linear_cross_entropy(*leaves[:2], target, leaves[2], chunk_bytes=chunk_bytes)
    loss.backward()
    ref = [t.detach().clone().requires_grad_() for t in leaves]
    expected = _unfused(*ref, target)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=2e-3, rtol=2e-3)
    for name, got, want in zip(("hidden", "weight", "bias"), leaves, ref):
        assert_close_scaled(got.grad, want.grad, 2e-2, 2e-2, name)


def test_compiled_callers_get_the_same_loss(fresh_dynamo):
    """Under torch.compile the op is the plain head + loss (no loop of launches to trace), with the same value and
    gradients."""
    target = _targets(26, 301).reshape(2, 13)
    hidden, weight, bias = _leaves(torch.float32)
    compiled = torch.compile(lambda h: linear_cross_entropy(h, weight, target, bias), backend="aot_eager",
                             fullgraph=True)  # fmt: skip
    loss = compiled(hidden)
    loss.backward()
    ref = hidden.detach().clone().requires_grad_()
    expected = _unfused(ref, weight, bias, target)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref.grad, atol=1e-6, rtol=1e-5)
