"""The whole-step fast path (``enable_fast_path``) and compiled generation (``compile_for_generation``).

CPU tests compile with the ``aot_eager`` backend and ``fullgraph=True`` (a graph break fails the test) and compare
with the same model run eagerly: the compiled graph runs the same ops, so losses, gradients and greedy tokens are
equal, not merely close. Liger-Kernel is replaced by a recording stand-in where its choice of kernels is tested (its
kernels need a GPU); GPU tests use the real one when it is installed.
"""

from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch
from peft import get_peft_model

import peft_fastlora
from peft_fastlora import block_checkpointing, fast_norms, fast_path
from peft_fastlora.ops import FORCE_TRITON_ENV
from tests.utils import TINY_LLAMA, fast_config, load_quantized, save_tiny_llama, saved_bytes, tiny_tokenizer, tokens

AOT = {"backend": "aot_eager", "fullgraph": True}


def fastlora_model(path, seed: int = 5, device: str = "cpu", **config):
    torch.manual_seed(seed)
    model = get_peft_model(load_quantized(path, device=device), fast_config(**{"lora_alpha": 8, **config}))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B = 0 would hide the LoRA term from every comparison
            torch.nn.init.normal_(param, std=0.05)
    return model


def set_checkpointing(model, mode: str) -> None:
    base = model.get_base_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if mode == "off":
            base.gradient_checkpointing_disable()
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("ckpt", ["off", "non-reentrant", "reentrant"])
def test_compiled_blocks_match_eager_exactly(tiny_llama_path, ckpt):
    ids = torch.randint(3, 128, (2, 16))
    eager, fast = fastlora_model(tiny_llama_path), fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(fast, liger=False, compile_blocks=True, fused_loss=False,
                                            compile_options=AOT)  # exactness of the blocks: the loss stays as is
    assert report.compiled_blocks == len(fast_path.decoder_blocks(fast.get_base_model())) == 2
    for model in (eager, fast):
        model.train()
        set_checkpointing(model, ckpt)
    loss_e, grads_e = loss_and_grads(eager, ids)
    loss_f, grads_f = loss_and_grads(fast, ids)
    assert torch.equal(loss_e, loss_f)
    assert grads_e.keys() == grads_f.keys() and len(grads_e) == 28  # 2 layers x 7 linears x (A, B)
    for name in grads_e:
        assert torch.equal(grads_e[name], grads_f[name]), name


def test_compiled_blocks_share_their_graphs(tmp_path):
    """Blocks reuse each other's compiled code: no recompile per layer (a real model has 32+ layers, and dynamo runs
    a function eagerly once it has recompiled `recompile_limit` times). Two graphs for six blocks: the first block's
    input (the frozen embedding's output) does not require grad, the others' do."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = fastlora_model(save_tiny_llama(tmp_path, num_hidden_layers=6))
    report = peft_fastlora.enable_fast_path(model, liger=False, compile_blocks=True, compile_options=AOT)
    assert report.compiled_blocks == 6
    model.train()
    loss_and_grads(model, torch.randint(3, 128, (2, 16)))
    assert counters["stats"]["unique_graphs"] == 2


def test_eval_and_generation_run_eagerly_and_match(tiny_llama_path):
    ids = torch.randint(3, 128, (1, 5))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    plain, fast = fastlora_model(tiny_llama_path).eval(), fastlora_model(tiny_llama_path).eval()
    peft_fastlora.enable_fast_path(fast, liger=False, compile_blocks=True, compile_options=AOT)
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.inference_mode():
        assert torch.equal(plain.generate(input_ids=ids, **kwargs), fast.generate(input_ids=ids, **kwargs))
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled for generation: blocks ran eagerly


def test_liger_missing_warns_once_or_raises(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(fast_path, "liger_available", lambda: False)
    model = fastlora_model(tiny_llama_path)
    with pytest.warns(UserWarning, match=r"peft-fastlora\[fast\]") as records:
        report = peft_fastlora.enable_fast_path(model)
    assert len([r for r in records if "Liger" in str(r.message)]) == 1
    assert report.liger_kernels == [] and "Liger-Kernel not applied" in report.notes
    with pytest.raises(RuntimeError, match="not installed"):
        peft_fastlora.enable_fast_path(model, liger=True)


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in for liger_kernel's architecture table that records what the fast path asks for."""
    calls = []

    def apply_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                    model=None):  # fmt: skip
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, rms_norm=rms_norm, swiglu=swiglu, model=model,
                          fused_linear_cross_entropy=fused_linear_cross_entropy))  # fmt: skip

    module = types.ModuleType("liger_kernel.transformers.monkey_patch")
    module.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_llama}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", module)
    monkeypatch.setattr(fast_path, "liger_available", lambda: True)
    return calls


def test_liger_gets_the_transformers_model_and_all_kernels_when_eager(tiny_llama_path, fake_liger):
    """Liger gets every kernel but the loss, which the fused loss computes; without the fused loss, Liger's."""
    model = fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(model, fuse_mlp=False)
    (call,) = fake_liger
    assert call["model"] is model.get_base_model()  # Liger patches a transformers model, never the PeftModel
    assert call["rope"] and call["rms_norm"] and call["swiglu"]
    assert not (call["cross_entropy"] or call["fused_linear_cross_entropy"])
    assert set(report.liger_kernels) == {"rope", "rms_norm", "swiglu"} and report.fused_loss
    report = peft_fastlora.enable_fast_path(fastlora_model(tiny_llama_path), fuse_mlp=False, fused_loss=False)
    assert fake_liger[1]["fused_linear_cross_entropy"] and not report.fused_loss
    assert set(report.liger_kernels) == {"fused_linear_cross_entropy", "rope", "rms_norm", "swiglu"}


def test_fused_mlp_replaces_liger_swiglu(tiny_llama_path, fake_liger):
    model = fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(model)
    (call,) = fake_liger
    assert not call["swiglu"] and call["rms_norm"] and call["rope"]
    assert report.fused_mlps == TINY_LLAMA["num_hidden_layers"] and "swiglu" not in report.liger_kernels


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("ckpt", ["off", "non-reentrant", "reentrant"])
def test_fused_mlp_matches_the_module_math_and_keeps_less(tiny_llama_path, monkeypatch, ckpt):
    """Through the Triton path (interpreter): loss and every LoRA grad of the fused MLP match the unfused model's
    within bf16 rounding (the tiny model computes in bf16; the fused SwiGLU rounds once where the module rounds
    twice); the forward keeps one tokens x intermediate tensor less per layer; inference runs the module's own
    math."""
    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    plain, fused = fastlora_model(tiny_llama_path), fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(fused, liger=False)
    assert report.fused_mlps == TINY_LLAMA["num_hidden_layers"]
    for model in (plain, fused):
        set_checkpointing(model, ckpt)
        model.train()
    ids = tokens(rows=2, seq=8)
    loss_plain, grads_plain = _loss_and_grads(plain, ids)
    loss_fused, grads_fused = _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss_fused, loss_plain, atol=1e-4, rtol=1e-4)
    assert grads_fused.keys() == grads_plain.keys() and any("down_proj" in n for n in grads_fused)
    for name, grad in grads_plain.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_fused[name], grad, atol=2e-2 * scale, rtol=2e-2, msg=name)
    if ckpt == "off":
        sizes = {name: saved_bytes(lambda m=model: m(input_ids=ids, labels=ids))
                 for name, model in (("plain", plain), ("fused", fused))}  # fmt: skip
        h_bytes = ids.numel() * TINY_LLAMA["intermediate_size"] * 2  # bf16
        assert sizes["plain"] - sizes["fused"] >= TINY_LLAMA["num_hidden_layers"] * h_bytes
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


def _count_calls(monkeypatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(fast_path, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_path, name, counting)
    return calls


def _block_forwards_with_grad(ckpt: str) -> int:
    """Block forwards with grad enabled in a fast-path training step of the tiny model: non-reentrant checkpointing
    runs each block twice with grad, reentrant runs the first forward without (the module's math, nothing to fuse
    for) and the recompute with; the last block is not checkpointed (``recompute_last_block=False``), so it runs
    once, with grad."""
    layers = TINY_LLAMA["num_hidden_layers"]
    return {"off": layers, "non-reentrant": 2 * layers - 1, "reentrant": layers}[ckpt]


@pytest.mark.parametrize("ckpt", ["off", "non-reentrant", "reentrant"])
def test_whole_lora_mlp_matches_the_module_math(tiny_llama_blocks_path, monkeypatch, ckpt):
    """With ``fuse_mlp="all"``, MLPs of whole absmax blocks with plain adapters on all three projections train
    through the whole-MLP op (each LoRA term inside its matmul) in every layer; loss and every LoRA grad match the
    unfused model's within bf16 rounding, and the default (``fuse_mlp=True``) runs gate/up as a projection group
    into the fused down projection instead (``grouped_lora_mlp``)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    plain, whole, down = (fastlora_model(tiny_llama_blocks_path) for _ in range(3))
    assert peft_fastlora.enable_fast_path(whole, liger=False, fuse_mlp="all").fused_mlps == 2
    assert peft_fastlora.enable_fast_path(down, liger=False).fused_mlps == TINY_LLAMA["num_hidden_layers"]
    whole_calls, down_calls = _count_calls(monkeypatch, "lora_mlp"), _count_calls(monkeypatch, "grouped_lora_mlp")
    for model in (plain, whole, down):
        set_checkpointing(model, ckpt)
        model.train()
    ids = tokens(rows=2, seq=8)
    loss_plain, grads_plain = _loss_and_grads(plain, ids)
    loss_whole, grads_whole = _loss_and_grads(whole, ids)
    forwards = _block_forwards_with_grad(ckpt)
    assert whole_calls[0] == forwards and down_calls[0] == 0
    _loss_and_grads(down, ids)
    assert whole_calls[0] == forwards and down_calls[0] == forwards
    torch.testing.assert_close(loss_whole, loss_plain, atol=1e-4, rtol=1e-4)
    assert grads_whole.keys() == grads_plain.keys() and any("gate_proj" in n for n in grads_whole)
    for name, grad in grads_plain.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_whole[name], grad, atol=2e-2 * scale, rtol=2e-2, msg=name)
    with torch.no_grad():  # inference runs the module's own math
        torch.testing.assert_close(whole(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_fused_mlp_on_other_swiglu_architectures(tmp_path, monkeypatch, model_type):
    """Not Llama-only: a tiny Qwen2 and Mistral get the fused MLP in every layer, and their loss and gradients match the
    unfused model's within bf16 rounding (Triton path under the interpreter)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY_LLAMA)).save_pretrained(tmp_path)
    plain, fused = fastlora_model(tmp_path), fastlora_model(tmp_path)
    report = peft_fastlora.enable_fast_path(fused, liger=False)
    assert report.model_type == model_type and report.fused_mlps == TINY_LLAMA["num_hidden_layers"]
    ids = tokens(rows=2, seq=8)
    loss_plain, grads_plain = _loss_and_grads(plain.train(), ids)
    loss_fused, grads_fused = _loss_and_grads(fused.train(), ids)
    torch.testing.assert_close(loss_fused, loss_plain, atol=1e-4, rtol=1e-4)
    for name, grad in grads_plain.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_fused[name], grad, atol=2e-2 * scale, rtol=2e-2, msg=name)


def _count_group_calls(monkeypatch) -> list[int]:
    from peft_fastlora import projection_group

    calls = [0]
    real = projection_group.lora_linear_group

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(projection_group, "lora_linear_group", counting)
    return calls


@pytest.mark.parametrize("model_type, ckpt", [("llama", "off"), ("llama", "non-reentrant"), ("llama", "reentrant"),
                                              ("qwen2", "off")])  # fmt: skip
def test_projection_groups_match_the_module_math(tmp_path, monkeypatch, model_type, ckpt):
    """q/k/v and gate/up train as one op each in every layer (Qwen2's q/k/v with their biases), once per block
    forward with grad; loss
    and every LoRA grad match the separate projections' within bf16 rounding (Triton path under
    the interpreter); inference runs each layer's own path, with the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY_LLAMA)).save_pretrained(tmp_path)
    plain, fused = fastlora_model(tmp_path), fastlora_model(tmp_path)
    peft_fastlora.enable_fast_path(plain, liger=False, group_projections=False)
    report = peft_fastlora.enable_fast_path(fused, liger=False)
    layers = TINY_LLAMA["num_hidden_layers"]
    assert report.projection_groups == 2 * layers and "projection groups: 4" in report.summary()
    calls, mlp_calls = _count_group_calls(monkeypatch), _count_calls(monkeypatch, "grouped_lora_mlp")
    for model in (plain, fused):
        set_checkpointing(model, ckpt)
        model.train()
    ids = tokens(rows=2, seq=8)
    loss_plain, grads_plain = _loss_and_grads(plain, ids)
    assert calls[0] == mlp_calls[0] == 0
    loss_fused, grads_fused = _loss_and_grads(fused, ids)
    forwards = _block_forwards_with_grad(ckpt)
    assert calls[0] == mlp_calls[0] == forwards  # q/k/v; gate/up inside the fused MLP
    torch.testing.assert_close(loss_fused, loss_plain, atol=1e-4, rtol=1e-4)
    assert grads_fused.keys() == grads_plain.keys() and any("k_proj" in n for n in grads_fused)
    k_proj = fused.get_base_model().model.layers[0].self_attn.k_proj
    assert (model_type == "qwen2") == (k_proj.base_layer.bias is not None)  # the group adds Qwen2's (frozen) biases
    for name, grad in grads_plain.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_fused[name], grad, atol=2e-2 * scale, rtol=2e-2, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)
    assert calls[0] == mlp_calls[0] == forwards


def test_projection_group_turns_itself_off_for_a_module_that_calls_otherwise(tiny_llama_path, monkeypatch):
    """An attention module that does not call q, k and v on one input one after the other: the group warns once,
    turns off, and every projection gives what it gives alone."""
    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    model = fastlora_model(tiny_llama_path)
    assert peft_fastlora.enable_fast_path(model, liger=False).projection_groups == 2 * TINY_LLAMA["num_hidden_layers"]
    attn = model.get_base_model().model.layers[0].self_attn
    x, y = torch.randn(2, 3, TINY_LLAMA["hidden_size"]), torch.randn(2, 3, TINY_LLAMA["hidden_size"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = attn.q_proj(x)
        with pytest.warns(UserWarning, match="does not call q_proj, k_proj, v_proj on one input"):
            k = attn.k_proj(y)
        v = attn.v_proj(y)
        for got, (layer, inp) in zip((q, k, v), ((attn.q_proj, x), (attn.k_proj, y), (attn.v_proj, y))):
            torch.testing.assert_close(got, type(layer).forward(layer, inp))  # bf16 tolerances
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.q_proj(x), attn.k_proj(y)  # off: no second warning


def test_fused_mlp_steps_aside_for_what_it_cannot_fuse(tiny_llama_path):
    """Dropout on the down projection's LoRA input (or two active adapters) keeps the module's math."""
    model = fastlora_model(tiny_llama_path, lora_dropout=0.1)
    peft_fastlora.enable_fast_path(model, liger=False)
    down = model.get_base_model().model.layers[0].mlp.down_proj
    assert down.single_adapter_args(torch.zeros(1, TINY_LLAMA["intermediate_size"])) is None
    plain = fastlora_model(tiny_llama_path)
    peft_fastlora.enable_fast_path(plain, liger=False, fuse_mlp=False)
    assert "_fused_mlp_forward" not in str(plain.get_base_model().model.layers[0].mlp.forward)


def test_liger_keeps_only_the_loss_when_blocks_compile(tiny_llama_path, fake_liger):
    """Compiled blocks leave Liger only the loss: with the fused loss, nothing (Liger is not called at all)."""
    report = peft_fastlora.enable_fast_path(fastlora_model(tiny_llama_path), compile_blocks=True, compile_options=AOT)
    assert not fake_liger and report.liger_kernels == [] and report.fused_loss
    report = peft_fastlora.enable_fast_path(fastlora_model(tiny_llama_path), compile_blocks=True, fused_loss=False,
                                            compile_options=AOT)  # fmt: skip
    (call,) = fake_liger
    assert call["fused_linear_cross_entropy"] and not (call["rope"] or call["rms_norm"] or call["swiglu"])
    assert report.liger_kernels == ["fused_linear_cross_entropy"]


def test_liger_applies_only_the_kernels_named(tiny_llama_path, fake_liger):
    model = fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(model, liger=["fused_linear_cross_entropy", "rms_norm"])
    (call,) = fake_liger
    assert call["fused_linear_cross_entropy"] and call["rms_norm"] and not (call["rope"] or call["swiglu"])
    assert sorted(report.liger_kernels) == ["fused_linear_cross_entropy", "rms_norm"]
    assert not report.fused_loss  # naming Liger's loss asks for it instead of ours


def test_liger_kernel_names_are_checked_and_strict(tiny_llama_path, fake_liger, monkeypatch):
    model = fastlora_model(tiny_llama_path)
    for bad in (["rmsnorm"], [], [3]):
        with pytest.raises(ValueError, match=r"`liger` must be .* kernel names from .*rms_norm"):
            peft_fastlora.enable_fast_path(model, liger=bad)
    monkeypatch.setattr(fast_path, "liger_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):  # naming kernels asks for them: no silent fallback
        peft_fastlora.enable_fast_path(model, liger=("fused_linear_cross_entropy",))


def test_lora_on_lm_head_turns_the_fused_loss_off(tiny_llama_path, fake_liger):
    model = fastlora_model(tiny_llama_path, target_modules=["q_proj", "lm_head"])
    report = peft_fastlora.enable_fast_path(model)
    assert not fake_liger[0]["fused_linear_cross_entropy"] and not report.fused_loss
    assert any("lm_head" in note for note in report.notes)
    assert any("fused loss off" in note and "nn.Linear" in note for note in report.notes)


def test_unsupported_architecture_warns_or_raises(tiny_llama_path, fake_liger, monkeypatch):
    model = fastlora_model(tiny_llama_path)
    monkeypatch.setattr(model.get_base_model().config, "model_type", "not-a-liger-model")
    with pytest.warns(UserWarning, match="no kernels for model_type 'not-a-liger-model'"):
        report = peft_fastlora.enable_fast_path(model)
    assert report.liger_kernels == [] and not fake_liger
    with pytest.raises(RuntimeError, match="not-a-liger-model"):
        peft_fastlora.enable_fast_path(model, liger=True)


@pytest.mark.parametrize(("name", "value"), [("liger", "yes"), ("compile_blocks", "auto"), ("offload_activations", 1),
                                             ("fuse_mlp", "down"), ("group_projections", "qkv")])
def test_bad_arguments_name_the_argument(tiny_llama_path, name, value):
    model = fastlora_model(tiny_llama_path)
    with pytest.raises(ValueError, match=f"`{name}` must be one of .* got {value!r}"):
        peft_fastlora.enable_fast_path(model, **{name: value})


def test_not_a_transformers_model_is_refused():
    with pytest.raises(TypeError, match="transformers model or a PeftModel"):
        peft_fastlora.enable_fast_path(torch.nn.Linear(2, 2))


def _attention_calls(model) -> list[int]:
    """Per decoder block, how often its attention runs (inside the checkpointed forward: recomputes count)."""
    calls = [0] * TINY_LLAMA["num_hidden_layers"]
    for i, block in enumerate(fast_path.decoder_blocks(model.get_base_model())):
        block.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("ckpt", ["off", "non-reentrant"])
def test_fused_ops_take_windows_in_every_block_of_a_checkpointed_model(tiny_llama_path, ckpt):
    """What the fast path's fused ops would cut W into (``(forward, backward)`` windows), read in each block's MLP:
    whole without checkpointing; under it, backward windows in every block (the kept last block too, whose
    backward peaks as a recomputed one's) and forward windows in the recompute only."""
    from peft_fastlora.ops import lora_linear

    model = fastlora_model(tiny_llama_path)
    peft_fastlora.enable_fast_path(model, liger=False)
    model.train()
    set_checkpointing(model, ckpt)
    seen = []
    for index, block in enumerate(fast_path.decoder_blocks(model.get_base_model())):  # (inside the checkpointed call)
        block.mlp.register_forward_pre_hook(lambda *_, i=index: seen.append((i, tuple(lora_linear.fused_op_windows()))))
    model(input_ids=tokens(rows=2, seq=8), labels=tokens(rows=2, seq=8)).loss.backward()
    most = lora_linear.MAX_WINDOWS
    if ckpt == "off":
        assert seen == [(0, (1, 1)), (1, (1, 1))]
    else:  # block 0's forward, the kept block 1, then block 0's recompute inside the backward pass
        assert seen == [(0, (1, most)), (1, (1, most)), (0, (most, most))]


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_last_block_is_not_recomputed_and_the_step_is_unchanged(tiny_llama_path, ckpt):
    """Under gradient checkpointing the fast path runs the last block once (its backward follows the loss at once);
    loss and grads are those of the step that recomputes it, bit for bit. Enabling checkpointing again (as the
    Trainer does at ``train()``) keeps the policy; ``recompute_last_block=True`` checkpoints every block."""
    ids = tokens(rows=2, seq=8)
    kept, recomputed = fastlora_model(tiny_llama_path), fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(kept, liger=False)
    assert report.last_block_kept and "last block recomputed under checkpointing: no" in report.summary()
    assert not peft_fastlora.enable_fast_path(recomputed, liger=False, recompute_last_block=True).last_block_kept
    results = {}
    for name, model in (("kept", kept), ("recomputed", recomputed)):
        model.train()
        set_checkpointing(model, "off")
        set_checkpointing(model, ckpt)  # set anew after the fast path, as the Trainer does
        calls = _attention_calls(model)
        results[name] = _loss_and_grads(model, ids)
        assert calls == ([2, 1] if name == "kept" else [2, 2])  # reentrant: the first forward counts, without grad
    (loss_k, grads_k), (loss_r, grads_r) = results["kept"], results["recomputed"]
    assert grads_k.keys() == grads_r.keys() and len(grads_k) == 28
    if ckpt == "non-reentrant":
        assert torch.equal(loss_k, loss_r)
        for name in grads_k:
            assert torch.equal(grads_k[name], grads_r[name]), name
    else:  # the reentrant loss comes from forwards without grad (the module's math) but for the kept block's (fused)
        torch.testing.assert_close(loss_k, loss_r, atol=1e-3, rtol=1e-3)
        for name in grads_k:  # the backward's recompute is the same; its inputs differ by that rounding
            scale = grads_r[name].abs().max().item()
            torch.testing.assert_close(grads_k[name], grads_r[name], atol=2e-2 * scale, rtol=2e-2, msg=name)


def test_the_checkpoint_policy_survives_copies(tiny_llama_path):
    """A deep copy or an unpickled fast-path model keeps its policy, bound to its own blocks (checkpointing enabled on
    the copy: transformers' own input hook of a checkpointed model does not pickle)."""
    import copy
    import pickle

    model = fastlora_model(tiny_llama_path)
    peft_fastlora.enable_fast_path(model, liger=False)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copied.train()
        set_checkpointing(copied, "non-reentrant")
        calls = _attention_calls(copied)
        _loss_and_grads(copied, tokens(rows=2, seq=8))
        assert calls == [2, 1]


def test_offload_on_cpu_is_a_noted_no_op(tiny_llama_path):
    model = fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(model, liger=False, offload_activations=True)
    assert report.offload_activations is False and any("not on CUDA" in n for n in report.notes)


def test_compiled_generation_matches_eager_and_restores(tiny_llama_path):
    from torch._dynamo.utils import counters

    ids = torch.randint(3, 128, (2, 6))
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))  # fmt: skip
    model = fastlora_model(tiny_llama_path).eval()
    with torch.inference_mode():
        eager = model.generate(input_ids=ids, **kwargs)
    peft_fastlora.compile_for_generation(model, mode=None, **AOT)  # fullgraph: a graph break fails here
    assert model.get_base_model().generation_config.cache_implementation == "static"
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        compiled = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(eager, compiled)
    assert counters["stats"]["unique_graphs"] == 1  # the decode step; the prompt ran eagerly
    peft_fastlora.restore_eager_generation(model)
    assert "forward" not in model.get_base_model().__dict__
    assert model.get_base_model().generation_config.cache_implementation is None


# ---- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("min_bytes", [0, 1 << 14])  # every saved input; the hidden states only (32 KiB)
def test_offloaded_checkpointing_matches_and_moves_inputs_to_cpu(tiny_llama_path, monkeypatch, min_bytes):
    """Offloaded block inputs come back bit-identical; one GPU tensor waits for its copy to the host at a time, none
    after backward; restoring a block's inputs starts the copy back of what was offloaded before them, and every such
    copy is taken (none left behind on the side stream)."""
    ids = torch.randint(3, 128, (2, 64), device="cuda")
    packed, waiting, ahead = [], [], []
    original_pack, original_ahead = block_checkpointing._pack, block_checkpointing._Offloaded.restore_ahead

    def recording_pack(hooks, _, tensor):
        out = original_pack(hooks, min_bytes, tensor)  # the tiny model's activations are small
        packed.append(not isinstance(out, torch.Tensor))
        waiting.append(len(hooks.pending))  # the copy just started; the ones before it are released
        return out

    def recording_ahead(item, side):
        ahead.append(item)
        return original_ahead(item, side)

    monkeypatch.setattr(block_checkpointing, "_pack", recording_pack)  # before the hooks bind it
    monkeypatch.setattr(block_checkpointing._Offloaded, "restore_ahead", recording_ahead)
    plain, fast = fastlora_model(tiny_llama_path, device="cuda"), fastlora_model(tiny_llama_path, device="cuda")
    report = peft_fastlora.enable_fast_path(fast, liger=False, offload_activations=True, fuse_mlp=False,
                                            group_projections=False, fused_loss=False,
                                            recompute_last_block=True)  # the offload alone, of both blocks: same bits
    assert report.offload_activations
    for model in (plain, fast):
        model.train()
        set_checkpointing(model, "non-reentrant")
    hooks = fast_path.transformers_model(fast).__dict__[block_checkpointing.OFFLOAD_HOOKS]
    for _ in range(2):  # the second step starts with what the first left
        loss_p, grads_p = loss_and_grads(plain, ids)
        loss_f, grads_f = loss_and_grads(fast, ids)
        assert sum(packed) >= 2, "the two block inputs did not go to CPU memory"
        assert max(waiting) == 1 and hooks.pending == []  # one GPU tensor held at a time; none after backward
        assert ahead and all(item.ahead is None for item in ahead)  # restored ahead, and every one taken
        assert hooks.offloaded == []  # everything offloaded came back
        assert torch.equal(loss_p, loss_f)
        for name in grads_p:
            assert torch.equal(grads_p[name], grads_f[name]), name
        packed.clear(), waiting.clear(), ahead.clear()


@pytest.mark.gpu
def test_offload_forgets_forwards_dropped_without_backward(tiny_llama_path, monkeypatch):
    """Forwards whose graph is dropped without a backward (an evaluation loss under grad, a step skipped on overflow)
    leave their offloaded inputs unrestored: the list of them stays at its cap, and the next step still gives the
    plain model's bits."""
    original_pack = block_checkpointing._pack
    monkeypatch.setattr(block_checkpointing, "_pack", lambda hooks, _, tensor: original_pack(hooks, 0, tensor))
    ids = torch.randint(3, 128, (2, 64), device="cuda")
    plain, fast = fastlora_model(tiny_llama_path, device="cuda"), fastlora_model(tiny_llama_path, device="cuda")
    report = peft_fastlora.enable_fast_path(fast, liger=False, offload_activations=True, fuse_mlp=False,
                                            group_projections=False, fused_loss=False, recompute_last_block=True)
    assert report.offload_activations
    for model in (plain, fast):
        model.train()
        set_checkpointing(model, "non-reentrant")
    hooks = fast_path.transformers_model(fast).__dict__[block_checkpointing.OFFLOAD_HOOKS]
    assert hooks.max_unrestored == 4 * len(fast_path.transformers_model(fast).model.layers)
    per_forward = []
    for _ in range(6):
        before = len(hooks.offloaded)
        fast(input_ids=ids, labels=ids).loss.detach()  # the graph is dropped here, nothing restored
        per_forward.append(len(hooks.offloaded) - before)
    assert per_forward[0] >= 2, "the block inputs were not offloaded"
    assert len(hooks.offloaded) == hooks.max_unrestored  # capped, not growing by a forward's worth each time
    loss_p, grads_p = loss_and_grads(plain, ids)
    loss_f, grads_f = loss_and_grads(fast, ids)
    assert torch.equal(loss_p, loss_f)
    for name in grads_p:
        assert torch.equal(grads_p[name], grads_f[name]), name
    assert hooks.pending == [] and len(hooks.offloaded) <= hooks.max_unrestored


@pytest.fixture
def restore_llama_module(monkeypatch):
    """Liger-Kernel replaces functions and classes of transformers' Llama module for the whole process (RoPE, the
    RMSNorm and MLP classes); put them back after the test so that later tests see stock Llama."""
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))


def _has_liger_rms_norm(model) -> bool:
    """Liger patches the final norm either by class or by binding its forward to the instance (which the fast path's
    row-wise norm keeps as the forward it replaced, ``fast_norms.py``)."""
    norm = model.get_base_model().model.norm
    forward = norm.forward
    if getattr(forward, "__func__", None) is fast_norms._rms_norm_forward:
        forward = forward.__wrapped__
    return type(norm).__name__ == "LigerRMSNorm" or forward.__func__.__qualname__.startswith("LigerRMSNorm")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tiny_llama_path", "tiny_llama_blocks_path"])  # down projection / whole MLP fused
def test_fast_path_with_liger_tracks_plain_fastlora_over_20_steps(path, request, restore_llama_module):
    path = request.getfixturevalue(path)
    ids = torch.randint(3, 128, (4, 64), device="cuda")
    curves = []
    for use_fast in (False, True):
        model = fastlora_model(path, device="cuda")
        if use_fast:  # on the blocks model, the whole-MLP op
            report = peft_fastlora.enable_fast_path(model, liger=True, fuse_mlp="all")
            assert report.liger_kernels and report.rms_norms == 2 * model.config.num_hidden_layers + 1
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        curve = []
        for _ in range(20):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    plain, fast = curves
    assert fast[-1] < fast[0]  # it trains
    # bf16 rounding in different kernel orders: within 2% of the plain loss at every step.
    torch.testing.assert_close(fast, plain, rtol=2e-2, atol=0)


@pytest.mark.gpu
def test_compiled_generation_on_gpu_replays_cuda_graphs_with_same_tokens(tiny_llama_path):
    from torch._dynamo.utils import counters

    model = fastlora_model(tiny_llama_path, device="cuda").eval()
    with torch.no_grad():  # wide logit margins: greedy tokens must not flip on last-bit differences
        model.get_base_model().lm_head.weight.mul_(20)
    ids = torch.randint(3, 128, (2, 6), device="cuda")
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids), cache_implementation="static")  # fmt: skip
    with torch.inference_mode():
        eager = model.generate(input_ids=ids, **kwargs)
    peft_fastlora.compile_for_generation(model)
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        for _ in range(3):  # compile, record, replay
            compiled = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(eager, compiled)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.gpu
def test_trainer_use_liger_kernel_with_a_fastlora_model(tiny_llama_path, tmp_path, restore_llama_module):
    """The documented Trainer recipe: `TrainingArguments(use_liger_kernel=True)` patches the transformers model under
    the PeftModel and trains the FastLoRA adapters."""
    from transformers import Trainer, TrainingArguments

    model = fastlora_model(tiny_llama_path, device="cuda")
    ids = torch.randint(3, 128, (8, 32))
    data = [{"input_ids": row, "labels": row} for row in ids]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                             report_to=[], save_strategy="no", disable_tqdm=True, bf16=True, use_liger_kernel=True,
                             logging_steps=1, seed=0)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert _has_liger_rms_norm(model)
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no adapter weight moved"


# ---- TRL --------------------------------------------------------------------------------------------------------


def _sft_trainer(model, tmp_path, device: str, steps: int, **config):
    """TRL's ``SFTTrainer`` on 16 random rows of the tiny model's ids, bf16, ``steps`` logged steps."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tests.safety.helpers import token_batch, trainer_kwargs

    args = trl.SFTConfig(**{**trainer_kwargs(tmp_path, device, "bf16", steps), **config})
    dataset = datasets.Dataset.from_dict({"input_ids": token_batch(batch=16).tolist()})
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer())


def _train_moves_every_adapter(trainer, model) -> list[float]:
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL 1.15 deprecates use_liger_kernel
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == trainer.args.max_steps and all(math.isfinite(v) for v in losses), losses
    still = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not still, f"adapter tensors that did not train: {still}"
    return losses


def _forwards_per_step(model) -> int:
    """Block forwards per training step: SFTConfig checkpoints by default, and the recompute runs each block again but
    the last (the fast path keeps its activations)."""
    layers = TINY_LLAMA["num_hidden_layers"]
    return 2 * layers - 1 if model.get_base_model().is_gradient_checkpointing else layers


def test_sft_trainer_trains_through_the_fused_mlp(tiny_llama_path, tmp_path, monkeypatch):
    """`enable_fast_path` before TRL's `SFTTrainer`: its loss (TRL's own tiled LM head) runs the decoder blocks, whose
    MLPs take the fused SwiGLU + down projection in every training step, and every adapter tensor trains."""
    if not torch.cuda.is_available():
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    model = fastlora_model(tiny_llama_path)
    assert peft_fastlora.enable_fast_path(model, liger=False).fused_mlps == TINY_LLAMA["num_hidden_layers"]
    calls = _count_calls(monkeypatch, "grouped_lora_mlp")
    trainer = _sft_trainer(model, tmp_path, "cpu", steps=3)
    _train_moves_every_adapter(trainer, model)
    assert calls[0] == 3 * _forwards_per_step(model)


@pytest.mark.gpu
def test_sft_trainer_use_liger_kernel_with_a_fastlora_model(tiny_llama_path, tmp_path, restore_llama_module):
    """`SFTConfig(use_liger_kernel=True)` with a FastLoRA model: Liger's layer kernels patch the transformers model
    under the PeftModel, and SFT trains every adapter tensor with finite losses."""
    model = fastlora_model(tiny_llama_path, device="cuda")
    trainer = _sft_trainer(model, tmp_path, "cuda", steps=4, use_liger_kernel=True)
    _train_moves_every_adapter(trainer, model)
    assert _has_liger_rms_norm(model)


@pytest.mark.gpu
def test_sft_trainer_after_enable_fast_path_on_gpu(tiny_llama_path, tmp_path, restore_llama_module, monkeypatch):
    """The fast path (Liger's kernels, the fused MLP) and then TRL's `SFTTrainer` on a GPU: fused MLPs in every step,
    Liger's RMSNorm in the model, every adapter tensor trained, finite losses."""
    model = fastlora_model(tiny_llama_path, device="cuda")
    report = peft_fastlora.enable_fast_path(model, liger=True)
    assert report.fused_mlps == TINY_LLAMA["num_hidden_layers"] and "rms_norm" in report.liger_kernels
    calls = _count_calls(monkeypatch, "grouped_lora_mlp")
    trainer = _sft_trainer(model, tmp_path, "cuda", steps=4)
    _train_moves_every_adapter(trainer, model)
    assert calls[0] == 4 * _forwards_per_step(model)
    assert _has_liger_rms_norm(model)


def test_a_fast_path_model_pickles_and_deep_copies(tiny_llama_path):
    """The fused MLPs and the fused loss replace forwards per instance: a copy's forwards are bound to the copy (its
    own adapters), and the original keeps its loss."""
    import copy
    import pickle

    model = fastlora_model(tiny_llama_path)
    report = peft_fastlora.enable_fast_path(model, liger=False)
    assert report.fused_loss and report.fused_mlps
    model.train()
    ids = tokens(rows=2, seq=8)
    loss = model(input_ids=ids, labels=ids).loss
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        mlp = copied.get_base_model().model.layers[0].mlp
        assert mlp.forward.__self__ is mlp and copied.get_base_model().forward.__self__ is copied.get_base_model()
        torch.testing.assert_close(copied(input_ids=ids, labels=ids).loss, loss, atol=0, rtol=0)
        with torch.no_grad():
            copied.get_base_model().model.layers[0].mlp.down_proj.lora_B["default"].weight.mul_(5)
        assert not torch.equal(copied(input_ids=ids, labels=ids).loss, loss)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, loss)
