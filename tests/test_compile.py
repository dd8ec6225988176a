"""torch.compile through real FastLoRA layers: no graph breaks, and the same results as eager.

On CPU the Triton path is forced (``force_triton``: the kernels run under the interpreter), so the custom ops are what
dynamo traces, through a real FastLoRA layer built from a bitsandbytes model, and through a Llama decoder block made
of them, with and without activation checkpointing. The ``aot_eager`` backend runs the very same kernels and aten ops
as eager, so compiled results must be bit-identical. The ``gpu`` tests compile with Inductor, including
``mode="reduce-overhead"`` (CUDA graphs).
"""

import warnings

import pytest
import torch
from peft import get_peft_model
from torch.utils.checkpoint import checkpoint

import peft_fastlora
from tests.ops.conftest import force_triton  # noqa: F401  (the one force-Triton fixture)
from tests.utils import load_quantized


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def fastlora_model(path, bits=4, device="cpu", target_modules="all-linear"):
    kwargs = {"bits": 8} if bits == 8 else {"bits": 4, "double_quant": True, "compute_dtype": torch.bfloat16}
    config = peft_fastlora.FastLoraConfig(r=4, target_modules=target_modules, init_lora_weights=False)
    return get_peft_model(load_quantized(path, dtype=torch.bfloat16, **kwargs).to(device), config)


def decoder_block(model):
    return model.base_model.model.model.layers[0]


def block_inputs(model, batch=2, seq=5, device="cpu"):
    """Hidden states and the rotary position embeddings a Llama decoder layer takes."""
    llama = model.base_model.model.model
    hidden = torch.randn(batch, seq, llama.config.hidden_size, dtype=torch.bfloat16, device=device)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    return hidden, llama.rotary_emb(hidden, positions)


def assert_no_graph_breaks(fn, *args):
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters() if p.requires_grad]


def run_fwd_bwd(fn, module, x, *args):
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = fn(x, *args)
    y.float().square().sum().backward()
    return [y.detach()] + [g.clone() for g in grads(module, x)]


@pytest.mark.usefixtures("force_triton")
@pytest.mark.parametrize("bits", [4, 8])
def test_fullgraph_through_a_fastlora_layer_takes_the_custom_ops(fresh_dynamo, tiny_llama_path, bits):
    layer = fastlora_model(tiny_llama_path, bits).base_model.model.model.layers[0].mlp.down_proj
    assert type(layer).__name__.startswith("FastLora")
    x = torch.randn(3, 5, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    eager = run_fwd_bwd(layer, layer, x)
    assert all(torch.equal(a, b) for a, b in zip(run_fwd_bwd(compiled, layer, x), eager))
    assert "peft_fastlora.lora_linear" in graphs[-1]
    with torch.no_grad():  # one decode row: the fused small-M op
        x1 = x[:1, :1].detach()
        assert torch.equal(compiled(x1), layer(x1))
    assert "peft_fastlora.lora_linear_small_m" in graphs[-1]


@pytest.mark.usefixtures("force_triton")
def test_tracing_meets_no_functools_cache(fresh_dynamo, tiny_llama_path, monkeypatch):
    """Dynamo ignores a functools cache it traces through and warns once per process: the code a compiled layer call
    runs (dispatch decisions, FSDP check, kernel loading) keeps its constants elsewhere."""
    layer = fastlora_model(tiny_llama_path).base_model.model.model.layers[0].mlp.down_proj
    # dynamo prints each warning once per process: forget the ones earlier tests printed
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for rows in (1, 6):  # the small-M op and the general one
            x = torch.randn(rows, layer.in_features, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), layer(x))
    cache_warnings = [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    assert not cache_warnings, cache_warnings


@pytest.mark.usefixtures("force_triton")
@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_decoder_block_compiles_without_graph_breaks(fresh_dynamo, tiny_llama_path, use_checkpoint, monkeypatch):
    """A Llama decoder block whose 7 linears are FastLoRA layers: one graph, no breaks, forward and grads bit-identical
    to eager, with and without ``torch.utils.checkpoint`` around the block."""
    model = fastlora_model(tiny_llama_path)
    block = decoder_block(model).train()
    hidden, position_embeddings = block_inputs(model)
    hidden.requires_grad_()

    def step(hidden, cos, sin):
        if use_checkpoint:
            return checkpoint(block, hidden, position_embeddings=(cos, sin), use_reentrant=False)
        return block(hidden, position_embeddings=(cos, sin))

    # transformers >= 5.2x with the `kernels` package routes attention through a hub-kernel wrapper that sets a
    # ContextVar per call; inside a checkpoint that is a side effect dynamo refuses to trace unless told that the
    # backward's recompute need not replay it (it need not: the variable is only read during that call)
    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if use_checkpoint and hasattr(torch._dynamo.config, flag):
        monkeypatch.setattr(torch._dynamo.config, flag, True)
    assert_no_graph_breaks(step, hidden, *position_embeddings)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = run_fwd_bwd(step, block, hidden, *position_embeddings)
    got = run_fwd_bwd(compiled, block, hidden, *position_embeddings)
    assert len(got) == len(eager) > 2
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("force_triton")
def test_decode_step_of_the_whole_model_has_no_graph_breaks(fresh_dynamo, tiny_llama_path):
    """One decode step (a single new token, no grad) of the whole FastLoRA model: one graph, the fused small-M op."""
    model = fastlora_model(tiny_llama_path).eval()
    ids = torch.randint(0, 128, (1, 1))
    llama = model.base_model.model
    with torch.no_grad():
        assert_no_graph_breaks(llama, ids)
        torch._dynamo.reset()
        eager = llama(ids).logits
        compiled = torch.compile(llama, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(compiled, eager)


# ---- GPU: Inductor and CUDA graphs ----------------------------------------------------------------------------------
# Inductor compiles the ops around ours (RMSNorm, rotary, SiLU, residual adds) into its own kernels, which round
# differently from eager's; our kernels run as they do eagerly. Those roundings compound through the layers: on an
# H100 the largest difference was 3.3 bf16 ulps of the largest logit (0.0073 of 0.22). A bound of 8 ulps (8 * 2**-8
# relative) covers that with room and would still catch a wrong scaling of a layer.
GPU_BOUND = 8 * 2.0**-8


def assert_close_to_eager(got, want):
    scale = want.detach().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=GPU_BOUND * scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 2048])
def test_gpu_layer_compiled_is_bit_identical(fresh_dynamo, tiny_llama_path, bits, m):
    """A single FastLoRA layer is one custom op, so Inductor has nothing to fuse: bit-identical to eager."""
    layer = fastlora_model(tiny_llama_path, bits, device="cuda").base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(m, layer.in_features, dtype=torch.bfloat16, device="cuda", requires_grad=m > 16)
    eager = layer(x)
    out = torch.compile(layer, fullgraph=True)(x)
    assert torch.equal(out, eager)
    if x.requires_grad:
        out.float().sum().backward()
        assert layer.lora_A["default"].weight.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_layer_reduce_overhead_replays_a_cuda_graph(fresh_dynamo, tiny_llama_path, bits, m):
    """``mode="reduce-overhead"``: the layer is captured in a CUDA graph; replays with new inputs match eager
    bit for bit (no host syncs or Python state skipped by the replay)."""
    layer = fastlora_model(tiny_llama_path, bits, device="cuda").base_model.model.model.layers[0].mlp.down_proj.eval()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(5):  # warm-up runs, recording, then replays
            x = torch.randn(m, layer.in_features, dtype=torch.bfloat16, device="cuda")
            out = compiled(x).clone()
            assert torch.equal(out, layer(x)), step


@pytest.mark.gpu
def test_gpu_decode_step_reduce_overhead(fresh_dynamo, tiny_llama_path):
    """The whole model's decode step under ``mode="reduce-overhead"``: one graph (no breaks), replayed as a CUDA
    graph, logits within the Inductor bound of eager."""
    model = fastlora_model(tiny_llama_path, device="cuda").eval()
    llama = model.base_model.model
    with torch.no_grad():
        assert_no_graph_breaks(llama, torch.randint(0, 128, (1, 1), device="cuda"))
        torch._dynamo.reset()
        compiled = torch.compile(llama, mode="reduce-overhead", fullgraph=True)
        for _ in range(5):
            ids = torch.randint(0, 128, (1, 1), device="cuda")
            assert_close_to_eager(compiled(ids).logits.clone(), llama(ids).logits)


@pytest.mark.gpu
def test_gpu_static_cache_generate_matches_eager(tiny_llama_path):
    """transformers' compiled generation (static cache, compiled decode step) gives the tokens of eager generation."""
    model = fastlora_model(tiny_llama_path, device="cuda").eval()
    ids = torch.randint(0, 128, (1, 6), device="cuda")
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        eager = model.generate(input_ids=ids, **kwargs)
        compiled = model.generate(input_ids=ids, cache_implementation="static", **kwargs)
    assert torch.equal(compiled, eager)


@pytest.mark.gpu
def test_gpu_whole_model_inductor(fresh_dynamo, tiny_llama_path):
    model = fastlora_model(tiny_llama_path, device="cuda").eval()
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model.base_model.model, fullgraph=True)(ids).logits
    assert_close_to_eager(compiled, eager)
