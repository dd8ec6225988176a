"""GraphedTrainStep: the same training as a hand-written loop (accumulation, clipping, LR schedule), the warm-up
undone, bad input refused by name, and (GPU) the recorded step replays the eager step's training, with the fast
path, checkpointing, activation offload and LoRA dropout, and notices what a recording cannot follow."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

import peft_fastlora
from peft_fastlora.graphed_step import (
    GraphedTrainStep,
    _plain_causal,
    _prepare_optimizer,
    _takes_fused_update,
    _TrainingState,
    causal_attention,
)
from tests.utils import TINY_LLAMA, fast_config, load_quantized


def _model(path, device="cpu", seed=5, **config):
    torch.manual_seed(seed)
    model = get_peft_model(load_quantized(path, device=device), fast_config(**{"lora_alpha": 8, **config}))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B = 0 would make the first steps' A gradients zero
            torch.nn.init.normal_(param, std=0.05)
    return model.train()


def _batches(count, rows=2, seq=12, device="cpu", seed=11):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, TINY_LLAMA["vocab_size"], (rows, seq), generator=gen).to(device)
        labels = ids.clone()
        labels[:, :3] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


def _optimizer(model, lr=1e-2):
    # eps well above the smallest gradients: Adam turns a gradient near zero into a step of +-lr whatever its size, so
    # with the default eps two runs that differ in the last bit of such a gradient end a whole lr apart.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01,
                                  eps=1e-3)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, schedule


def _hand_loop(model, batches, accumulation, max_norm, autocast_dtype=None):
    optimizer, schedule = _optimizer(model)
    losses, norms = [], []
    for i, batch in enumerate(batches, 1):
        with torch.autocast(batch["input_ids"].device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch, use_cache=False).loss
        (loss / accumulation).backward()
        losses.append(loss.detach())
        if i % accumulation == 0:
            if max_norm is not None:
                norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                            max_norm, foreach=True))  # fmt: skip
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
    return torch.stack(losses), norms


def _step_loop(model, batches, accumulation, max_norm, autocast_dtype=None, **kwargs):
    optimizer, schedule = _optimizer(model)
    step = GraphedTrainStep(model, optimizer, batches[0], accumulation_steps=accumulation, max_grad_norm=max_norm,
                            autocast_dtype=autocast_dtype, **kwargs)  # fmt: skip
    losses, norms, first_grads = [], [], None
    for i, batch in enumerate(batches, 1):
        losses.append(step(batch))
        if i == 1 and accumulation > 1:  # before the first update: the first micro-batch's gradients
            first_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if i % accumulation == 0:
            if max_norm is not None:
                norms.append(step.grad_norm.clone())
            schedule.step()
    step.first_grads = first_grads
    return torch.stack(losses), norms, step


def _assert_close_scaled(got, expected, name, rel):
    """Within ``rel`` of the largest magnitude of ``expected`` (bf16 training: a bare rtol fails near zero)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=rel * scale, rtol=rel, msg=lambda m: f"{name}: {m}")


def _adapters(model):
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("accumulation, max_norm", [(1, None), (2, 0.05)])
def test_eager_step_trains_like_a_hand_written_loop(tiny_llama_path, accumulation, max_norm):
    batches = _batches(4)
    expected_model, got_model = _model(tiny_llama_path), _model(tiny_llama_path)
    start = _adapters(got_model)
    expected, expected_norms = _hand_loop(expected_model, batches, accumulation, max_norm)
    got, norms, _ = _step_loop(got_model, batches, accumulation, max_norm, cuda_graphs=False)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for norm, expected_norm in zip(norms, expected_norms, strict=True):
        torch.testing.assert_close(norm, expected_norm, atol=0, rtol=0)
    trained, reference = _adapters(got_model), _adapters(expected_model)
    assert any(not torch.equal(trained[n], start[n]) for n in start)  # it trained
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("stepped_before", [False, True])
def test_training_state_put_back_after_the_warm_up(stepped_before):
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = torch.optim.AdamW(params, lr=0.1, amsgrad=True)

    def train():
        sum((p * torch.rand_like(p)).sum() for p in params).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if stepped_before:
        train()
    before = [p.detach().clone() for p in params]
    state_before = {i: {k: v.clone() for k, v in optimizer.state[p].items()} for i, p in enumerate(params)}
    saved = _TrainingState(params, optimizer)
    draw = torch.rand(4)
    train()
    train()
    saved.restore()
    torch.testing.assert_close(torch.rand(4), draw, atol=0, rtol=0)  # the RNG too
    for param, value in zip(params, before):
        torch.testing.assert_close(param.detach(), value, atol=0, rtol=0)
    for i, param in enumerate(params):
        state = optimizer.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        for key, value in state.items():
            expected = state_before[i][key] if stepped_before else torch.zeros_like(value)
            torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("choice", [{}, {"foreach": True}, {"foreach": False}, {"fused": True}], ids=str)
def test_only_an_update_left_to_torch_is_made_fused(choice):
    param = torch.nn.Parameter(torch.randn(4))
    group = torch.optim.AdamW([param], lr=1e-3, **choice).param_groups[0]
    assert not _takes_fused_update(group, torch.device("cpu"))  # CPU: no recording
    assert not _takes_fused_update(group, torch.device("cuda"))  # parameters elsewhere than the recording


def test_optimizer_made_recordable_in_place():
    params = [torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    (lr,) = _prepare_optimizer(optimizer, torch.device("cpu"))
    group = optimizer.param_groups[0]
    assert group["capturable"] is True and group["lr"] is lr and lr.dtype == torch.float32
    assert not group["fused"]  # the fused update is for CUDA recordings only
    torch.testing.assert_close(lr, torch.tensor(3e-4))
    schedule.step()  # schedulers fill the tensor in place
    assert optimizer.param_groups[0]["lr"] is lr
    torch.testing.assert_close(lr, torch.tensor(1.5e-4))


def test_bad_arguments_are_refused_by_name(tiny_llama_path):
    model = _model(tiny_llama_path)
    batch = _batches(1)[0]
    params = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.AdamW(params)
    cases = [
        (dict(optimizer=torch.optim.SGD(params, lr=0.1)), TypeError, "SGD"),
        (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
        (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
        (dict(autocast_dtype=torch.float16), ValueError, "gradient scaler"),
        (dict(autocast_dtype=torch.int8), ValueError, "autocast_dtype"),
        (dict(warmup_steps=0), ValueError, "warmup_steps"),
        (dict(example_batch=[batch["input_ids"]]), TypeError, "example_batch"),
        (dict(example_batch={**batch, "use_cache": False}), TypeError, "forward_kwargs"),
        (dict(cuda_graphs=True), ValueError, "cuda_graphs=True"),
        (dict(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.ones(1), requires_grad=False)])), ValueError,
         "nothing to train"),
    ]  # fmt: skip
    for overrides, error, words in cases:
        kwargs = {"optimizer": adam, "example_batch": batch, **overrides}
        with pytest.raises(error, match=words):
            GraphedTrainStep(model, kwargs.pop("optimizer"), kwargs.pop("example_batch"), **kwargs)


def test_batches_of_other_shapes_or_keys_are_refused(tiny_llama_path):
    model = _model(tiny_llama_path)
    batch = _batches(1)[0]
    step = GraphedTrainStep(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), batch,
                            cuda_graphs=False)  # fmt: skip
    longer = _batches(1, seq=13)[0]
    with pytest.raises(ValueError, match=r"batch\['input_ids'\].*\(2, 12\).*\(2, 13\).*pad or pack"):
        step(longer)
    with pytest.raises(ValueError, match="keys of the example batch"):
        step({"input_ids": batch["input_ids"]})
    with pytest.raises(ValueError, match=r"batch\['labels'\].*torch.int64.*torch.int32"):
        step({**batch, "labels": batch["labels"].int()})
    step(batch)  # the right batch still trains


def test_a_forward_without_loss_is_refused(tiny_llama_path):
    model = _model(tiny_llama_path)
    batch = {"input_ids": _batches(1)[0]["input_ids"]}
    step = GraphedTrainStep(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), batch,
                            cuda_graphs=False)  # fmt: skip
    with pytest.raises(ValueError, match="no loss.*labels"):
        step(batch)


def test_recorded_model_notices_what_a_replay_would_get_wrong(tiny_llama_path):
    from peft_fastlora._cuda_graphs import RecordedModel

    model = _model(tiny_llama_path)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    recorded = RecordedModel(model)
    model(**_batches(1)[0]).loss.backward()
    optimizer.step()  # in place: what a replay does
    assert recorded.unchanged()
    model.eval()
    assert not recorded.unchanged()
    model.train()
    assert recorded.unchanged()
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    lora_a = layer.lora_A["default"].weight
    with torch.no_grad():
        lora_a.data = lora_a.data.clone()  # same Parameter, new storage
    assert not recorded.unchanged()
    recorded = RecordedModel(model)
    quantized = layer.base_layer.weight  # a bitsandbytes Params4bit: read without its __torch_function__
    assert type(quantized).__name__ == "Params4bit" and recorded.unchanged()
    with torch.no_grad():
        quantized.data = quantized.data.clone()
    assert not recorded.unchanged()
    changes = [
        lambda m: m.add_adapter("other", fast_config()) or m.set_adapter("other"),
        lambda m: m.get_base_model().model.layers[1].mlp.down_proj.merge(),
        lambda m: m.base_model.disable_adapter_layers(),
        lambda m: setattr(m.get_base_model().model.layers[1], "mlp", torch.nn.Identity()),
    ]
    for change in changes:
        model = _model(tiny_llama_path)
        recorded = RecordedModel(model)
        change(model)
        assert not recorded.unchanged()


def _sdpa_spy(monkeypatch):
    """Records (mask given?, is_causal, capturing?) of every SDPA call."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal"), capturing))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_causal_attention_while_recording_gives_the_same_logits(tiny_llama_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation="sdpa")
    ids = _batches(1)[0]["input_ids"]
    calls = _sdpa_spy(monkeypatch)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with causal_attention(model, {"input_ids": ids}):
            assert model.config._attn_implementation != "sdpa"
            got = model(input_ids=ids).logits
        assert model.config._attn_implementation == "sdpa"
        with causal_attention(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}):
            assert model.config._attn_implementation == "sdpa"  # a padding mask: left as it is
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert calls[-1][:2] == (False, True)  # inside: no mask, SDPA's own causal kernel
    with pytest.raises(KeyError), causal_attention(model, {"input_ids": ids}):
        raise KeyError("boom")
    assert model.config._attn_implementation == "sdpa"  # put back after an error too


def test_which_configs_have_a_plain_causal_mask():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    ids = {"input_ids": torch.zeros(1, 2048, dtype=torch.long)}

    def sdpa(config):
        config._attn_implementation = "sdpa"
        return config

    assert _plain_causal(sdpa(LlamaConfig()), 2048, ids)
    assert _plain_causal(sdpa(Qwen2Config()), 2048, ids)  # sliding window off
    assert _plain_causal(sdpa(MistralConfig(sliding_window=4096)), 2048, ids)  # the window reaches the start
    assert not _plain_causal(sdpa(MistralConfig(sliding_window=1024)), 2048, ids)
    assert not _plain_causal(sdpa(LlamaConfig()), 2048, {**ids, "attention_mask": ids["input_ids"]})
    assert not _plain_causal(sdpa(LlamaConfig()), 2048, {**ids, "position_ids": ids["input_ids"]})
    eager = LlamaConfig()
    eager._attn_implementation = "eager"
    assert not _plain_causal(eager, 2048, ids)


# ---- GPU: the recorded step ------------------------------------------------------------------------------------


def _gpu_pair(path, fast_path: dict, ckpt: bool, **config):
    models = []
    for _ in range(2):
        model = _model(path, device="cuda", **config)
        if fast_path is not None:
            peft_fastlora.enable_fast_path(model, liger=False, **fast_path)
        if ckpt:
            model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        models.append(model)
    return models


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fast_path, ckpt",
    [(None, False), ({}, False), ({"offload_activations": True}, True), ({}, True), ({"compile_blocks": True}, False),
     ({"compile_blocks": True}, True)],
    ids=["fastlora", "fast-path", "fast-path-ckpt-offload", "fast-path-ckpt", "compiled-blocks",
         "compiled-blocks-ckpt"],
)  # fmt: skip
def test_recorded_step_trains_like_the_eager_step(tiny_llama_path, fast_path, ckpt):
    batches = _batches(6, device="cuda")
    eager_model, graphed_model = _gpu_pair(tiny_llama_path, fast_path, ckpt)
    expected, expected_norms, eager = _step_loop(eager_model, batches, 2, 0.05, torch.bfloat16, cuda_graphs=False)
    got, norms, step = _step_loop(graphed_model, batches, 2, 0.05, torch.bfloat16)
    assert step.cuda_graphs and step._graphs is not None
    # the recorded update is torch's fused one (the optimizer left the choice to torch), the eager one multi-tensor
    assert step.optimizer.param_groups[0]["fused"] and not eager.optimizer.param_groups[0]["fused"]
    assert step.first_grads.keys() == eager.first_grads.keys() and step.first_grads
    for name, grad in eager.first_grads.items():  # the recorded backward, before any update
        _assert_close_scaled(step.first_grads[name], grad, name, 1e-2)
    # The first replayed loss is the first eager loss: the warm-up was undone.
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected_norms), atol=1e-3, rtol=2e-2)
    trained, reference = _adapters(graphed_model), _adapters(eager_model)
    for name, value in reference.items():
        _assert_close_scaled(trained[name], value, name, 2e-2)


def _gradients(model, batch):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**batch, use_cache=False).loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("fast_path", [None, {}], ids=["fastlora", "fast-path"])
def test_recorded_step_without_accumulation_makes_its_gradients(tiny_llama_path, fast_path):
    # One micro-batch per update: the recording adopts the backward's own gradient tensors and never zeroes them, so
    # each replay must leave exactly its batch's gradients (a sum with the previous batch's would mean an add).
    batches = _batches(3, device="cuda")
    eager_model, graphed_model = _gpu_pair(tiny_llama_path, fast_path, False)
    optimizer = torch.optim.AdamW([p for p in graphed_model.parameters() if p.requires_grad], lr=0.0)  # no change
    step = GraphedTrainStep(graphed_model, optimizer, batches[0], autocast_dtype=torch.bfloat16)
    kept = None
    for i, batch in enumerate(batches):
        if i == 2:
            optimizer.zero_grad(set_to_none=True)  # the kept tensors come back
        step(batch)
        grads = {n: p.grad for n, p in graphed_model.named_parameters() if p.grad is not None}
        kept = kept or grads
        assert all(grads[n] is kept[n] for n in kept) and grads.keys() == kept.keys()
        expected = _gradients(eager_model, batch)
        assert expected.keys() == grads.keys() and expected
        for name, grad in expected.items():
            _assert_close_scaled(grads[name].float(), grad, name, 1e-2)


@pytest.mark.gpu
def test_recording_again_leaves_no_memory_behind(tiny_llama_path):
    """A step recorded, released and recorded again (a new GraphedTrainStep, as after a model change) ends with the
    memory the first one left: recordings share one side stream per device, so cuBLAS sets up no new workspace."""
    model = _model(tiny_llama_path, device="cuda")
    optimizer, _ = _optimizer(model)
    (batch,) = _batches(1, device="cuda")
    allocated = []
    for _ in range(3):
        step = peft_fastlora.GraphedTrainStep(model, optimizer, batch, autocast_dtype=torch.bfloat16)
        step(batch)
        step.release()
        del step
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[2] == allocated[1], allocated


@pytest.mark.gpu
def test_recorded_attention_is_causal_by_kernel(tiny_llama_path, monkeypatch):
    """transformers builds a full causal mask while a stream captures; the recording must still run SDPA with
    ``is_causal`` (3x faster attention on an H100) when the batch has no padding."""
    model = _model(tiny_llama_path, device="cuda")
    batches = _batches(2, device="cuda")
    calls = _sdpa_spy(monkeypatch)
    step = GraphedTrainStep(model, _optimizer(model)[0], batches[0], autocast_dtype=torch.bfloat16)
    recorded = [call for call in calls if call[2]]
    assert recorded and all(call[:2] == (False, True) for call in recorded), recorded
    assert model.get_base_model().config._attn_implementation == "sdpa"
    step(batches[1])


@pytest.mark.gpu
def test_dropout_recomputed_under_checkpointing_in_a_recording(tiny_llama_path):
    """The recompute of a checkpointed block must draw the forward's dropout masks again: with the same RNG state
    at recording, the recorded step with and without checkpointing trains the same."""
    batches = _batches(4, device="cuda")
    results = []
    for ckpt in (False, True):
        (model, _) = _gpu_pair(tiny_llama_path, {}, ckpt, lora_dropout=0.3)
        torch.manual_seed(21)
        losses, _, _ = _step_loop(model, batches, 1, None, torch.bfloat16)
        results.append((losses, _adapters(model)))
    (losses, adapters), (ckpt_losses, ckpt_adapters) = results
    torch.testing.assert_close(ckpt_losses, losses, atol=2e-3, rtol=2e-3)
    for name, value in adapters.items():
        _assert_close_scaled(ckpt_adapters[name], value, name, 2e-2)


@pytest.mark.gpu
def test_what_a_recording_cannot_follow_raises_and_what_it_can_is_followed(tiny_llama_path):
    model = _model(tiny_llama_path, device="cuda")
    batch = _batches(1, device="cuda")[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step = GraphedTrainStep(model, optimizer, batch, autocast_dtype=torch.bfloat16)
    step(batch)
    optimizer.param_groups[0]["lr"] = 0.0  # a number by hand: followed (AdamW with lr 0 changes nothing)
    before = _adapters(model)
    optimizer.zero_grad(set_to_none=True)  # followed: the recorded gradients come back
    step(batch)
    after = _adapters(model)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    optimizer.param_groups[0]["lr"] = 1e-2
    step(batch)
    assert any(not torch.equal(_adapters(model)[n], after[n]) for n in after)
    model.eval()
    with pytest.raises(RuntimeError, match="train/eval"):
        step(batch)
    model.train()
    step(batch)
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(RuntimeError, match="hyperparameter"):
        step(batch)
    optimizer.param_groups[0]["weight_decay"] = 0.01
    step.release()
    with pytest.raises(RuntimeError, match="released"):
        step(batch)
